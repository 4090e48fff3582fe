"""DeepSeek-V4 in the layout deepseek-ai/DeepSeek-V4-Flash is published in: the release's tensor
names (``layers.{i}.attn.wq_a.weight``, ``embed.weight``, ``hc_head_fn``, ...), FP8 e4m3 linears
with a UE8M0 ``.scale`` (``F8_E8M0``) per ``weight_block_size`` block, FP4 routed experts (``I8``
``[out, in/2]``, two E2M1 codes a byte, low nibble first, with a UE8M0 ``.scale`` ``[out, in/32]``),
everything else unquantized; ``expert_dtype: "fp4"`` at the top of ``config.json``.

A tiny transformers V4 (tests/families/test_deepseek_v4.py) is quantised here with numpy into that
layout (power-of-two scales, as DeepSeek's kernels round them; blocks of 24x40 so that partial blocks
and shard edges cut through them), and its dequantised weights are fed to transformers: otfload's f32
logits from the quantized checkpoint equal transformers' on the dequantised weights. transformers'
own FP8 dequantiser (``Fp8Dequantize``) reads the FP4 experts and the FP8 blocks as the numpy
reference does. At full size, V4-Flash's headers as published (69,187 tensors, the release's dtypes
and shapes) plan at 256 devices within 10 s and 1 GiB, one process's bytes within 1.1x its share.
"""

import json
import math
import re
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest

import otfload
from otfload.errors import QuantizationError
from otfload.plan.sharding import make_mesh
from tests.families.checks import MESHES
from tests.families.test_deepseek_v4 import NEEDS_REAL, REAL
from tests.helpers import hf_tensors, max_rel_diff, token_ids
from tests.helpers import jax_logits as logits

BLOCK = (24, 40)  # weight_block_size of the tiny checkpoints: partial blocks on every tiny axis
FP4_GROUP = 32  # one UE8M0 scale per 32 inputs of a routed expert
E4M3_MAX, E2M1_MAX = 448.0, 6.0
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
# The modules V4-Flash stores in FP8 (the rest of a layer is BF16 / F32 there), under each layer.
FP8_MODULES = ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b",
               *(f"ffn.shared_experts.w{k}" for k in (1, 2, 3)))  # fmt: skip
QUANT_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0"}
TOP = {"model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
       **{f"model.hc_head.hc_{x}": f"hc_head_{x}" for x in ("fn", "base", "scale")}}  # fmt: skip


def release_name(key: str) -> str:
    """The release's name of a tensor transformers' ``save_pretrained`` writes as ``key``."""
    if key in TOP:
        return TOP[key]
    key = key.removeprefix("model.")
    return key.replace(".attn.norm.weight", ".attn.kv_norm.weight")


def ue8m0(amax: np.ndarray, top: float) -> tuple[np.ndarray, np.ndarray]:
    """The smallest power of two ``s`` with ``amax / s <= top`` (DeepSeek's rounding): its UE8M0 byte
    (``127 + log2 s``) and its value."""
    exponent = np.ceil(np.log2(np.maximum(amax, 2.0**-100) / top))
    return (exponent + 127).astype(np.uint8), np.exp2(exponent).astype(np.float32)


def quantize_fp8(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``w`` ``[out, in]`` in FP8 e4m3 with a UE8M0 scale per ``block`` (partial edge blocks):
    ``(codes, scale bytes [ceil(out/b0), ceil(in/b1)], dequantised)``."""
    rows, cols = w.shape
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    padded = np.zeros((grid[0] * block[0], grid[1] * block[1]), np.float32)
    padded[:rows, :cols] = np.abs(w)
    amax = padded.reshape(grid[0], block[0], grid[1], block[1]).max(axis=(1, 3))
    scale_bytes, scale = ue8m0(amax, E4M3_MAX)
    expanded = np.repeat(np.repeat(scale, block[0], 0), block[1], 1)[:rows, :cols]
    codes = (w / expanded).astype(ml_dtypes.float8_e4m3fn)
    return codes, scale_bytes, codes.astype(np.float32) * expanded


def quantize_fp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``w`` ``[out, in]`` in FP4 E2M1 (nearest value) with a UE8M0 scale per 32 inputs: ``(int8
    [out, in/2] two codes a byte, low nibble first; scale bytes [out, in/32]; dequantised)``."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // FP4_GROUP, FP4_GROUP)
    scale_bytes, scale = ue8m0(np.abs(groups).max(-1), E2M1_MAX)
    x = (groups / scale[..., None]).reshape(rows, cols)
    index = np.abs(np.abs(x)[..., None] - E2M1).argmin(-1).astype(np.uint8)
    nibbles = index | np.where(x < 0, 8, 0).astype(np.uint8)  # bit 3: the sign
    packed = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).view(np.int8)
    values = np.where(x < 0, -1.0, 1.0).astype(np.float32) * E2M1[index]
    return packed, scale_bytes, (values.reshape(groups.shape) * scale[..., None]).reshape(rows, cols)


def _to_torch(a: np.ndarray, e8m0: bool = False):
    """``a`` as a torch tensor (FP8 codes and UE8M0 bytes through their bytes: torch takes no
    ml_dtypes arrays)."""
    import torch

    if e8m0 or a.dtype == ml_dtypes.float8_e4m3fn:
        raw = torch.from_numpy(np.ascontiguousarray(a).view(np.uint8))
        return raw.view(torch.float8_e8m0fnu if e8m0 else torch.float8_e4m3fn)
    return torch.from_numpy(np.ascontiguousarray(a))


def _save(tensors: dict[str, np.ndarray], e8m0: set[str], path: Path) -> None:
    """Two safetensors files (the UE8M0 tensors written as ``F8_E8M0``) and their index."""
    from safetensors.torch import save_file

    names = sorted(tensors)
    half = len(names) // 2
    weight_map = {}
    for k, part in enumerate((names[:half], names[half:])):
        file = f"model-0000{k + 1}-of-00002.safetensors"
        out = {}
        for name in part:
            out[name] = _to_torch(tensors[name], name in e8m0)
            weight_map[name] = file
        save_file(out, path / file)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


@pytest.fixture(scope="module")
def v4_published(tiny_checkpoints, tmp_path_factory):
    """``(quantized checkpoint, transformers on its dequantised weights, the stored quantized parts)``:
    the tiny V4 in the release's layout and names, and the reference built from the same numbers."""
    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV4ForCausalLM

    src, _ = tiny_checkpoints("deepseek_v4")
    hf = hf_tensors(src)
    quantized, dequantized, e8m0, parts = {}, dict(hf), set(), {}
    for key, w in hf.items():
        name = release_name(key)
        module = name.removesuffix(".weight")
        if ".ffn.experts." in name:
            parts[key] = quantize_fp4(w)
        elif module.split(".", 2)[-1] in FP8_MODULES:
            parts[key] = quantize_fp8(w, BLOCK)
        else:
            quantized[name] = w
            continue
        quantized[name], quantized[f"{module}.scale"], dequantized[key] = parts[key]
        e8m0.add(f"{module}.scale")
    path = tmp_path_factory.mktemp("v4") / "published"
    path.mkdir()
    config = json.loads((src / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps(
            {**config, "expert_dtype": "fp4", "quantization_config": {**QUANT_CONFIG, "weight_block_size": list(BLOCK)}}
        )
    )
    _save(quantized, e8m0, path)
    ref_path = path.parent / "dequantized"
    ref_path.mkdir()
    (ref_path / "config.json").write_text((src / "config.json").read_text())
    save_file(
        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in dequantized.items()}, ref_path / "model.safetensors"
    )
    reference = DeepseekV4ForCausalLM.from_pretrained(ref_path, dtype=torch.float32).eval()
    return path, reference, parts


def test_transformers_dequantiser_reads_the_layout_as_the_reference(v4_published):
    """transformers' ``Fp8Dequantize`` (its reading of V4-Flash's FP4 experts and FP8 blocks) gives
    the numpy reference's dequantised weights bit for bit, on blocks that divide the weight."""
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    _, _, parts = v4_published
    rng = np.random.default_rng(3)
    fp8 = quantize_fp8(rng.standard_normal((64, 96)).astype(np.float32), (16, 32))
    expert = next(v for k, v in parts.items() if ".experts.3.w2." in k)
    w2 = quantize_fp4(rng.standard_normal((8, 64)).astype(np.float32) * 3)
    dequantizer = Fp8Dequantize(None)
    for codes, scale, dequantized in (fp8, expert, w2):
        got = dequantizer._dequantize_one(
            _to_torch(codes),
            _to_torch(scale, e8m0=True),
            output_dtype=torch.float32,
        ).numpy()
        np.testing.assert_array_equal(got, dequantized)
        assert np.abs(got).max() > 0


@pytest.mark.parametrize(("scan_layers", "mesh_name"), [(True, "fsdp2_ep4"), (False, "fsdp2_tp4")])
def test_f32_logits_match_transformers_on_the_dequantised_weights(v4_published, scan_layers, mesh_name):
    """20 tokens on 8 simulated devices: every leaf read from the published layout (experts on ``ep``,
    heads on ``tp``: shard edges cut through the 24x40 blocks) within 1e-4 x max|logits|."""
    import torch

    path, reference, _ = v4_published
    mesh = make_mesh(MESHES[mesh_name])
    model = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers, dtype="float32")
    _, plan, source = otfload.plan_model(path, mesh=mesh, scan_layers=scan_layers)
    source.close()
    storage = {leaf: p.storage for leaf, p in plan.leaves.items()}
    experts = next(s for leaf, s in storage.items() if leaf.endswith("moe.experts.gate.kernel"))
    assert experts.startswith("fp4 e2m1 (int8, two a byte), float8_e8m0fnu scale per 32"), experts
    q_a = next(s for leaf, s in storage.items() if leaf.endswith("attn.q_a.kernel"))
    assert q_a == "fp8 float8_e4m3fn, float8_e8m0fnu scale per 24x40 block", q_a
    assert not any("fp" in s for leaf, s in storage.items() if leaf.endswith("router.kernel"))
    ids = token_ids(seq=20)
    with torch.no_grad():
        ref = reference(torch.tensor(ids)).logits.numpy()
    with jax.set_mesh(mesh):
        ours = logits(model, ids)
    assert max_rel_diff(ours, ref) <= 1e-4


def test_kept_packed_equals_the_dequantised_load(v4_published):
    """``quantized="keep"`` places the int8 FP4 codes and the UE8M0 bytes as stored; the model's
    logits equal the default (dequantised) load's. The dense side is the scanned logits test's load
    and input, so its forward reuses that test's compiled program."""
    path, _, _ = v4_published
    mesh = make_mesh(MESHES["fsdp2_ep4"])
    kept = otfload.from_pretrained(path, mesh=mesh, quantized="keep", dtype="float32")
    dense = otfload.from_pretrained(path, mesh=mesh, dtype="float32")
    w = kept.csa_moe_layers.moe.experts.gate.kernel.get_value()
    assert isinstance(w, otfload.QuantizedArray)
    ids = token_ids(seq=20)
    with jax.set_mesh(mesh):
        assert max_rel_diff(logits(kept, ids), logits(dense, ids)) <= 1e-6


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """A copy of the checkpoint ``src`` with its tensors passed through ``edit(tensors, e8m0 names)``."""
    import torch
    from safetensors import safe_open

    tensors, e8m0 = {}, set()
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                t = f.get_tensor(name)
                if t.dtype == torch.float8_e8m0fnu:
                    e8m0.add(name)
                if t.dtype in (torch.float8_e8m0fnu, torch.float8_e4m3fn):
                    raw = t.view(torch.uint8).numpy()
                    tensors[name] = raw if name in e8m0 else raw.view(ml_dtypes.float8_e4m3fn)
                else:
                    tensors[name] = t.numpy()
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    edit(tensors, e8m0)
    _save(tensors, e8m0, dst)
    return dst


def _drop_weight(tensors, e8m0):
    del tensors["layers.1.attn.wq_a.weight"]


def _bad_scale(tensors, e8m0):
    name = "layers.2.ffn.experts.0.w1.scale"
    tensors[name] = tensors[name][:, :1]


@pytest.mark.parametrize(("edit", "message"), [(_drop_weight, "UE8M0 scale"), (_bad_scale, "needs [32, 2]")])
def test_a_scale_that_fits_no_weight_is_a_typed_error(v4_published, tmp_path, edit, message):
    """A UE8M0 scale without its weight, or of a shape its FP4 expert does not fit, is a
    :class:`QuantizationError` naming it, never dropped."""
    path = _rewrite(v4_published[0], tmp_path / "bad", edit)
    with pytest.raises(QuantizationError, match=re.escape(message)):
        otfload.plan_model(path)


# --- real size ----------------------------------------------------------------------------------

# V4-Flash as published: 69,187 tensors in 46 files, 158,069,433,298 stored elements (int8 codes and
# UE8M0 scales one each), 148.65 GiB (a listing of the release's headers).
RELEASE_TENSORS, RELEASE_ELEMENTS, RELEASE_GIB = 69187, 158_069_433_298, 148.65


def flash_headers(path: Path) -> tuple[Path, dict]:
    """V4-Flash's published layout, headers only: the release's config (``expert_dtype: fp4``,
    ``quantization_config`` as published) and its tensors, names, dtypes and shapes, the MTP module
    (``mtp.0.*``, never read) included; one file per layer."""
    from otfload.families.deepseek_v4.config import CSA, SLIDING, deepseek_v4_config
    from tests.realsize import write_header_checkpoint

    config = json.loads(REAL.read_text())
    cfg = deepseek_v4_config(config)
    h, n, d, r, m, e = (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank,
                        cfg.moe_intermediate_size, cfg.num_experts)  # fmt: skip
    block = config["quantization_config"]["weight_block_size"]
    hc = (2 + cfg.hc_mult) * cfg.hc_mult

    def fp8(key: str, out: int, inp: int) -> dict:
        return {f"{key}.weight": ("F8_E4M3", (out, inp)),
                f"{key}.scale": ("F8_E8M0", (-(-out // block[0]), -(-inp // block[1])))}  # fmt: skip

    def fp4(key: str, out: int, inp: int) -> dict:
        return {f"{key}.weight": ("I8", (out, inp // 2)), f"{key}.scale": ("F8_E8M0", (out, inp // FP4_GROUP))}

    def ffn(p: str) -> dict:
        t = {f"{p}.gate.weight": ("BF16", (e, h))}
        for x in range(e):
            t |= fp4(f"{p}.experts.{x}.w1", m, h) | fp4(f"{p}.experts.{x}.w2", h, m) | fp4(f"{p}.experts.{x}.w3", m, h)
        return (
            t
            | fp8(f"{p}.shared_experts.w1", m, h)
            | fp8(f"{p}.shared_experts.w2", h, m)
            | fp8(f"{p}.shared_experts.w3", m, h)
        )

    def block_tensors(p: str) -> dict:
        a = f"{p}.attn"
        t = {f"{a}.attn_sink": ("F32", (n,)), f"{a}.kv_norm.weight": ("BF16", (d,)),
             f"{a}.q_norm.weight": ("BF16", (r,)), f"{p}.attn_norm.weight": ("BF16", (h,)),
             f"{p}.ffn_norm.weight": ("BF16", (h,))}  # fmt: skip
        t |= fp8(f"{a}.wq_a", r, h) | fp8(f"{a}.wq_b", n * d, r) | fp8(f"{a}.wkv", d, h)
        t |= fp8(f"{a}.wo_a", cfg.o_groups * cfg.o_lora_rank, n * d // cfg.o_groups)
        t |= fp8(f"{a}.wo_b", h, cfg.o_groups * cfg.o_lora_rank)
        for x in ("attn", "ffn"):
            t |= {f"{p}.hc_{x}_fn": ("F32", (hc, cfg.hc_mult * h)), f"{p}.hc_{x}_base": ("F32", (hc,)),
                  f"{p}.hc_{x}_scale": ("F32", (3,))}  # fmt: skip
        return t | ffn(f"{p}.ffn")

    def compressor(key: str, dim: int, rate: int, series: int) -> dict:
        return {
            f"{key}.ape": ("F32", (rate, series * dim)),
            f"{key}.norm.weight": ("BF16", (dim,)),
            f"{key}.wgate.weight": ("BF16", (series * dim, h)),
            f"{key}.wkv.weight": ("BF16", (series * dim, h)),
        }

    shards: dict[str, dict] = {}
    name = "model-{:05d}-of-00046.safetensors".format
    for i, (kind, mlp) in enumerate(zip(cfg.layer_types, cfg.mlp_layer_types, strict=True)):
        p, a = f"layers.{i}", f"layers.{i}.attn"
        t = block_tensors(p)
        t[f"{p}.ffn.gate.tid2eid" if mlp == "hash_moe" else f"{p}.ffn.gate.bias"] = (
            ("I64", (cfg.vocab_size, cfg.num_experts_per_tok)) if mlp == "hash_moe" else ("F32", (e,))
        )
        if kind != SLIDING:
            t |= compressor(f"{a}.compressor", d, cfg.compress_rates[kind], 2 if kind == CSA else 1)
        if kind == CSA:
            ih, idim = cfg.index_n_heads, cfg.index_head_dim
            t |= compressor(f"{a}.indexer.compressor", idim, cfg.compress_rates[kind], 2)
            t |= {f"{a}.indexer.weights_proj.weight": ("BF16", (ih, h))} | fp8(f"{a}.indexer.wq_b", ih * idim, r)
        shards[name(i + 1)] = t
    shards[name(44)] = {"embed.weight": ("BF16", (cfg.vocab_size, h))}
    shards[name(45)] = {"head.weight": ("BF16", (cfg.vocab_size, h)), "norm.weight": ("BF16", (h,)),
                        "hc_head_fn": ("F32", (cfg.hc_mult, cfg.hc_mult * h)), "hc_head_base": ("F32", (cfg.hc_mult,)),
                        "hc_head_scale": ("F32", (1,))}  # fmt: skip
    mtp = block_tensors("mtp.0") | {"mtp.0.ffn.gate.bias": ("F32", (e,))} | fp8("mtp.0.e_proj", h, h)
    mtp |= fp8("mtp.0.h_proj", h, h) | {f"mtp.0.{x}.weight": ("BF16", (h,)) for x in ("enorm", "hnorm", "norm")}
    mtp |= {"mtp.0.hc_head_fn": ("F32", (cfg.hc_mult, cfg.hc_mult * h)), "mtp.0.hc_head_base": ("F32", (cfg.hc_mult,)),
            "mtp.0.hc_head_scale": ("F32", (1,))}  # fmt: skip
    shards[name(46)] = mtp
    return write_header_checkpoint(path, shards, config), shards


@NEEDS_REAL
def test_flash_as_published_plans_at_256_devices(tmp_path):
    """``otfload inspect --devices 256`` of V4-Flash in its published layout (fsdp=32, ep=8, process 0
    of 32): the release's tensor count, element count and size reproduced; every leaf planned within
    10 s of CPU and 1 GiB, the routed experts FP4 and the attention FP8 with UE8M0 scales, the MTP
    module not read; one process's bytes within 1.1x its devices' share of the stored bytes."""
    from tests.realsize import ITEMSIZE, inspect_at_scale

    path, shards = flash_headers(tmp_path / "flash")
    specs = [spec for tensors in shards.values() for spec in tensors.values()]
    assert len(specs) == RELEASE_TENSORS
    assert sum(math.prod(shape) for _, shape in specs) == RELEASE_ELEMENTS
    total = sum(math.prod(shape) * ITEMSIZE[dtype] for dtype, shape in specs)
    assert abs(total / 2**30 - RELEASE_GIB) < 0.01, total / 2**30
    cpu, peak, info = inspect_at_scale(path, "fsdp=32,ep=8")
    print(f"plan: {cpu:.2f} s CPU, peak {peak / 2**20:.0f} MiB")
    assert cpu <= 10 and peak <= 2**30, (cpu, peak)
    assert info["model_type"] == "deepseek_v4"
    assert info["unused"] == []  # the MTP module is ignored by the table, never read
    leaves = {leaf["leaf"]: leaf for leaf in info["leaves"]}
    experts = leaves["csa_moe_layers.moe.experts.gate.kernel"]
    assert experts["shape"] == [20, 256, 2048, 4096] and "'ep'" in experts["sharding"], experts
    assert experts["storage"] == "fp4 e2m1 (int8, two a byte), float8_e8m0fnu scale per 32", experts
    fp8 = "fp8 float8_e4m3fn, float8_e8m0fnu scale per 128x128 block"
    for leaf in ("attn.q_b.kernel", "attn.o_a.kernel", "attn.indexer.q_b.kernel", "moe.shared.down.kernel"):
        assert leaves[f"csa_moe_layers.{leaf}"]["storage"] == fp8, leaf
    assert leaves["csa_moe_layers.attn.compressor.kv.kernel"]["storage"] == "bfloat16"
    totals = info["totals"]
    mtp = sum(math.prod(s) * ITEMSIZE[t] for t, s in shards["model-00046-of-00046.safetensors"].values())
    assert totals["source_bytes"] == total - mtp, (totals, total - mtp)
    share = totals["source_bytes"] * 8 / 256  # process 0 of 32 holds 8 of the 256 devices
    print(f"process bytes {totals['process_bytes'] / share:.3f}x, fetched {totals['fetch_bytes'] / share:.3f}x share")
    assert max(totals["process_bytes"], totals["fetch_bytes"]) <= 1.1 * share, (totals, share)
