"""Each shard loads exactly its slice of the checkpoint (no process group needed to check)."""
from pathlib import Path

import torch
import torch.nn.functional as F

from flagserve.distributed.parallel_state import ParallelContext
from flagserve.layers.embedding import VocabParallelEmbedding
from flagserve.models.config import load_model_config
from flagserve.models.decoder import stage_layers
from flagserve.models.loader import iterate_weights, load_model
from kernels import get_ops

CPU = torch.device("cpu")


def shard(path: str, **par):
    cfg = load_model_config(path)
    return load_model(path, cfg, get_ops("torch", CPU), torch.float32, CPU, ParallelContext(**par))


def split_qkv(attn) -> list[torch.Tensor]:
    d = attn.head_dim
    return attn.qkv_proj.weight.split([attn.num_heads * d, attn.num_kv_heads * d, attn.num_kv_heads * d])


def test_tensor_parallel_slices_reassemble(tiny_model_factory):
    path = tiny_model_factory("qwen3")  # GQA, explicit head_dim, q/k norm
    full = shard(path)
    ranks = [shard(path, tp_rank=r, tp_size=2) for r in range(2)]
    for i, layer in enumerate(full.layers):
        parts = [m.layers[i] for m in ranks]
        assert parts[0].self_attn.num_heads == 2 and parts[0].self_attn.num_kv_heads == 1
        for j, whole in enumerate(split_qkv(layer.self_attn)):  # q, k, v: heads split by rank
            assert torch.equal(torch.cat([split_qkv(p.self_attn)[j] for p in parts]), whole)
        assert torch.equal(torch.cat([p.self_attn.o_proj.weight for p in parts], 1),
                           layer.self_attn.o_proj.weight)
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        assert torch.equal(torch.cat([p.mlp.gate_up_proj.weight.chunk(2)[0] for p in parts]), gate)
        assert torch.equal(torch.cat([p.mlp.gate_up_proj.weight.chunk(2)[1] for p in parts]), up)
        # Row-parallel partial sums add up to the full MLP (what all_reduce does).
        x = torch.randn(3, full.config.hidden_size)
        ops = layer.mlp.ops
        partial = sum(F.linear(ops.silu_and_mul(p.mlp.gate_up_proj(x)), p.mlp.down_proj.weight)
                      for p in parts)
        torch.testing.assert_close(partial, layer.mlp(x))
    for name in ("embed_tokens", "lm_head"):
        assert torch.equal(torch.cat([getattr(m, name).weight for m in ranks]), getattr(full, name).weight)


def test_vocab_shards_pad_an_uneven_vocabulary():
    weight = torch.randn(10, 4)
    shards = [VocabParallelEmbedding(10, 4, r, 3) for r in range(3)]
    for s in shards:
        s.weight_loader(s.weight, weight)
    assert [s.weight.shape[0] for s in shards] == [4, 4, 4]
    assert torch.equal(torch.cat([s.weight for s in shards])[:10], weight)
    assert not shards[2].weight[2:].any()  # padding rows: zero logits, cut off after the gather


def test_pipeline_stages_hold_only_their_layers(tiny_model_factory):
    path = tiny_model_factory("llama", num_hidden_layers=3)
    full = shard(path)
    stages = [shard(path, pp_rank=r, pp_size=2) for r in range(2)]
    assert [list(stage_layers(3, r, 2)) for r in range(2)] == [[0], [1, 2]]
    first, last = stages
    assert len(first.layers) == 1 and len(last.layers) == 2
    assert first.embed_tokens is not None and first.lm_head is None and first.norm is None
    assert last.embed_tokens is None and last.lm_head is not None
    assert torch.equal(last.layers[0].mlp.down_proj.weight, full.layers[1].mlp.down_proj.weight)
    read = [name for name, _ in iterate_weights(Path(path), first.owns_weight)]
    assert read and all(".layers.1." not in n and ".layers.2." not in n for n in read)
    assert not any(n.startswith(("lm_head", "model.norm")) for n in read)


def test_tied_lm_head_loads_on_a_later_stage(tiny_model_factory):
    path = tiny_model_factory("qwen2")  # tie_word_embeddings
    full = shard(path)
    last = shard(path, pp_rank=1, pp_size=2)
    assert last.embed_tokens is None
    assert torch.equal(last.lm_head.weight, full.embed_tokens.weight)



def test_checkpoint_tensors_read_only_what_a_shard_keeps(tmp_path):
    from safetensors.torch import save_file

    from flagserve.models.loader import CheckpointTensor, iterate_weights

    full = torch.arange(6 * 8, dtype=torch.float32).view(6, 8)
    save_file({"w": full, "b": full[0].clone()}, str(tmp_path / "model.safetensors"))
    tensors = dict(iterate_weights(tmp_path))
    w = tensors["w"]
    assert isinstance(w, CheckpointTensor) and w.shape == (6, 8)
    assert torch.equal(w.narrow(0, 2, 3), full[2:5])
    assert torch.equal(w.narrow(1, 4, 4), full[:, 4:8])
    assert torch.equal(w[4:10], full[4:10])  # clamped like a tensor slice (padded vocab shard)
    assert torch.equal(w[:], full) and torch.equal(tensors["b"][:], full[0])
    assert w[7:9].shape == (0, 8)
