"""Structured outputs: a per-request grammar (JSON schema, regex, choice, EBNF) that masks the
logits at every sampled step, on xgrammar. params.py is what requests carry (picklable, no
xgrammar objects), compiler.py compiles grammars off the step loop, matchers.py follows each
sequence's tokens and writes the step's token bitmask."""
