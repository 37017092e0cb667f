"""Plain English text the tiny model's BPE tokenizer is trained on.

Hand-written and embedded so the tokenizer is reproducible offline. Changing this text changes
every token id the tiny model produces (and therefore every expected output in the tests), so
edit it only on purpose.
"""

CORPUS = """\
The kitchen smelled of fresh bread and coffee. She cut two onions, three carrots and a stalk of
celery, then fried them slowly in olive oil until they were soft and golden. Add a pinch of salt,
a little black pepper, and 500 ml of vegetable stock. Let the soup simmer for 20 minutes, stirring
now and then, and serve it hot with a slice of toasted bread.
To make pancakes, whisk 2 eggs with 250 grams of flour and 300 ml of milk. Heat a pan, pour in a
spoonful of batter and cook each side for about one minute. My grandmother always said that the
first pancake is for the cook. Do you prefer honey, lemon and sugar, or maple syrup?
A good tomato sauce needs time: garlic, tomatoes, basil and a splash of wine, cooked for an hour.
Boil the pasta in plenty of salted water; it should be tender but still firm to the bite.
Rice is cooked when the water has been absorbed. Cover the pot, turn off the heat, and wait 10
minutes before you lift the lid. The recipe serves four people, or two very hungry ones.
Bake the cake at 180 degrees for 35 to 40 minutes, until a knife comes out clean. Let it cool.

The weather today will be cloudy in the morning with light rain in the afternoon. Temperatures
will reach 18 degrees, falling to 9 degrees overnight. Tomorrow should be sunny and warmer, with a
gentle breeze from the west. Strong winds are expected on the coast on Friday, so take care.
It rained all night, and the streets were still wet when we walked to the station at 7:30.
In winter the lake freezes, and children skate on the ice while their parents drink hot tea.
The summer of 2019 was the hottest on record here; the river was lower than anyone remembered.
Snow fell quietly over the hills. By noon the sky had cleared and the mountains shone white.
Is it going to rain this weekend? The forecast says there is a 60% chance of showers on Sunday.

The computer would not start, so he checked the cable, the power supply and the fan. A program
is a list of instructions that a computer follows, one step at a time. Variables store values;
functions take inputs and return outputs. The server handles 1,200 requests per second.
Memory is fast but small, while a disk is slow but large. The cache keeps recent data close to
the processor. When the network fails, the client waits, retries, and finally reports an error.
She wrote a short script to rename 3,000 files, and it finished in less than a second.
Open the terminal, type the command, and press Enter. If you see "permission denied", check the
file's owner. Save your work often! Software has bugs, and tests help us find them early.
The model reads a sequence of tokens and predicts the next one. Each token is a number between 0
and 1,999. A batch of 8 sequences runs on the GPU at once, which is faster than running them one
by one. Version 2.4.1 fixed a crash on startup; version 3.0 added support for larger files.
Please enter your password (at least 12 characters), then click "Sign in" to continue.

One, two, three, four, five, six, seven, eight, nine, ten. Eleven, twelve, twenty, thirty, forty,
fifty, sixty, seventy, eighty, ninety, one hundred, one thousand, one million.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 25 32 42 50 64 99 100 128 256 512 1024 2048.
Two plus two is four. Seven times eight is 56. Half of 90 is 45, and a quarter of 100 is 25.
The train leaves at 08:15 and arrives at 11:40, a journey of 3 hours and 25 minutes.
The shop sold 347 books in March, 412 in April and 389 in May: 1,148 in total.
Pi is about 3.14159, and the square root of 2 is roughly 1.414. Is 97 a prime number? Yes.
The meeting is on 12 June 2024 at 14:00 in room 3B. Call me on 555-0199 if you are late.
Prices rose by 4.5% last year; a coffee now costs $3.20 and a sandwich costs $6.75.

Our dog loves long walks in the park. Cats sleep for most of the day and hunt at night.
Birds build nests in spring, and the young ones learn to fly in a few weeks. A horse can sleep
standing up. The whale is the largest animal that has ever lived; some weigh over 150 tonnes.
Bees visit thousands of flowers to make a single spoonful of honey. The fox ran across the field.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.

We took the early train to the city and spent the day in museums. The old bridge was built in
1885 and is still used by thousands of people every day. Don't forget your passport, tickets and
a charger for your phone! The hotel was small but clean, and the staff were very friendly.
From the top of the tower you can see the whole valley, the river, and the villages beyond it.
Where is the nearest bus stop? Turn left at the bakery, walk two blocks, and it's on your right.

She plays the piano every evening, and her brother plays the guitar. The concert started at
eight and ended just before eleven. Music can make us happy, calm, or even a little sad.
The team won the match 3-1 after a difficult first half. Running, swimming and cycling are
good for the heart. He trains five days a week and rests on the other two.
Plants need light, water and air. Water boils at 100 degrees Celsius at sea level. The Earth
goes around the Sun once a year, and the Moon goes around the Earth about once a month.
Light travels at nearly 300,000 kilometres per second. Scientists test ideas with careful
experiments, measure the results, and share what they learn with others.
In the garden we grow beans, peas, lettuce and potatoes. Water the seeds every morning, pull the
weeds, and in a few months you will have fresh vegetables for the table.
The library opens at nine. Children read stories, students study for exams, and old friends meet
to talk about books. History teaches us how people lived, worked, and solved their problems.

"Hello! How are you today?" "I'm fine, thank you. And you?" "Very well, thanks."
Could you help me with this, please? Of course. What do you need? I need to write a letter.
Thank you very much for your help. You're welcome; it was a pleasure.
What time is it? It's half past four. Let's meet again next week, on Tuesday or Wednesday.
Why is the sky blue? Sunlight is scattered by the air, and blue light is scattered the most.
Can you explain how a bicycle works? The pedals turn a chain, and the chain turns the wheel.
Write a short poem about the sea. The waves roll in, the waves roll out, the gulls all cry and
wheel about. Summarize the story in one sentence. A lost cat finds its way home after a storm.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday, Sunday. January, February, March, April,
May, June, July, August, September, October, November, December.
Red, orange, yellow, green, blue, indigo and violet are the colours of the rainbow.
Yes. No. Maybe. Sure! Wait... Really? Okay; fine: done. (Almost.) [Note: see page 7.] #1 @home
A, B, C, D, E, F, G, H, I, J, K, L, M, N, O, P, Q, R, S, T, U, V, W, X, Y, Z.
Everyone who came to the party brought something: bread, cheese, fruit, salad or a cake.
After dinner they sat by the fire and told stories until it was very late.
"""
