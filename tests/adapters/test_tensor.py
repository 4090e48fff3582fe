"""The merge arithmetic, box by box, against PEFT's own ``get_delta_weight``: plain modules,
embeddings, and the expert grouping of fused 3-D factors (``A [E·r, in]`` expert-major, ``B [out, r·E]``
rank-major), both orientations, whole-expert-stack boxes and one expert's slice of a fused pair."""

from __future__ import annotations

import copy
import itertools

import numpy as np
import pytest
import torch

from otfload.adapters.tensor import AdaptedTensor, LoraTerm
from otfload.index.header import TensorInfo
from tests.adapters.support import DOWN, GATE_UP

SCALE = 2.0  # lora_alpha 4 / r 2


def info(name: str, shape: tuple[int, ...]) -> TensorInfo:
    return TensorInfo(name, np.dtype(np.float32), shape, "f", 0, 4 * int(np.prod(shape)))


def read(arrays: dict[str, np.ndarray], parts) -> dict[str, np.ndarray]:
    """What the reader hands ``decode``: each part's box of its array."""
    return {role: arrays[i.name][tuple(slice(a, b) for a, b in box)] for role, (i, box) in parts.items()}


def boxes(shape: tuple[int, ...], cuts: int = 3):
    """Every box of ``shape`` whose bounds fall on ``cuts`` points per axis (uneven edges included)."""
    points = [sorted({0, d, *np.linspace(0, d, cuts).astype(int)[1:-1], d // 3}) for d in shape]
    spans = [[(a, b) for a, b in itertools.combinations(p, 2)] for p in points]
    return itertools.product(*spans)


def merge_box(term: LoraTerm, base: np.ndarray, a: np.ndarray, b: np.ndarray, box) -> np.ndarray:
    tensor = AdaptedTensor(info("w", base.shape), (term,))
    arrays = {"w": base, "A": a, "B": b}
    return tensor.decode(read(arrays, tensor.part_boxes(box)), box)


@pytest.fixture(scope="module")
def peft_experts(tiny_checkpoints):
    """PEFT ``ParamWrapper`` s on fused expert parameters: {(kind, param): (delta [E, d1, d2], A, B)}."""
    from peft import LoraConfig, get_peft_model

    out = {}
    gen = torch.Generator().manual_seed(0)
    for kind in ("mixtral", "gpt_oss"):
        _, torch_model = tiny_checkpoints(kind)
        config = LoraConfig(r=2, lora_alpha=4, target_modules=[], target_parameters=[GATE_UP, DOWN])
        model = get_peft_model(copy.deepcopy(torch_model), config)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=gen))
        outer = model.base_model.model.model.layers[0].mlp.experts  # down_proj wraps gate_up_proj
        for wrapper in (outer, outer.base_layer):
            with torch.no_grad():
                delta = wrapper.get_delta_weight("default").numpy()
            a, b = (factor_array(f["default"]) for f in (wrapper.lora_A, wrapper.lora_B))
            assert delta.shape == tuple(wrapper.get_param().shape)
            out[(kind, wrapper.parameter_name)] = (delta, a, b)
    return out


@pytest.mark.parametrize(("kind", "param"), [("mixtral", "gate_up_proj"), ("mixtral", "down_proj"),
                                             ("gpt_oss", "gate_up_proj"), ("gpt_oss", "down_proj")])
def test_fused_expert_boxes_equal_peft_delta(peft_experts, kind, param):
    """A box with a leading expert axis (GPT-OSS stores [E, in, out]: the transposed orientation)."""
    delta, a, b = peft_experts[(kind, param)]
    experts = delta.shape[0]
    term = LoraTerm(info("A", a.shape), info("B", b.shape), rank=2, scale=SCALE, transposed=kind == "gpt_oss",
                    experts=experts)
    base = np.zeros(delta.shape, np.float32)
    for box in boxes(delta.shape):
        want = delta[tuple(slice(s, e) for s, e in box)]
        np.testing.assert_allclose(merge_box(term, base, a, b, box), want, rtol=1e-5, atol=1e-6)


def test_one_expert_of_a_fused_pair_equals_its_slice_of_peft_delta(peft_experts):
    """Mixtral's stored w1/w3 are expert ``e``'s gate and up rows of the fused gate_up_proj delta."""
    delta, a, b = peft_experts[("mixtral", "gate_up_proj")]
    experts, fused_out, hidden = delta.shape
    half = fused_out // 2
    for e, offset in itertools.product(range(experts), (0, half)):
        term = LoraTerm(info("A", a.shape), info("B", b.shape), rank=2, scale=SCALE, experts=experts, expert=e,
                        out_offset=offset)
        base = np.zeros((half, hidden), np.float32)
        for box in boxes(base.shape):
            (r0, r1), (c0, c1) = box
            want = delta[e, offset + r0 : offset + r1, c0:c1]
            np.testing.assert_allclose(merge_box(term, base, a, b, box), want, rtol=1e-5, atol=1e-6)


def factor_array(factor) -> np.ndarray:
    """A LoRA factor's values (an ``nn.Linear`` for modules, a bare parameter for embeddings)."""
    return getattr(factor, "weight", factor).detach().numpy()


def test_linear_and_embedding_boxes_equal_peft(tiny_checkpoints):
    from peft import LoraConfig, get_peft_model

    _, torch_model = tiny_checkpoints("llama")
    config = LoraConfig(r=4, lora_alpha=6, use_rslora=True, target_modules=["q_proj", "embed_tokens"])
    model = get_peft_model(copy.deepcopy(torch_model), config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
    inner = model.base_model.model.model
    cases = [(inner.layers[1].self_attn.q_proj, "lora_A", "lora_B", False),
             (inner.embed_tokens, "lora_embedding_A", "lora_embedding_B", True)]
    for module, a_name, b_name, transposed in cases:
        with torch.no_grad():
            delta = module.get_delta_weight("default").numpy()
        a, b = (factor_array(getattr(module, n)["default"]) for n in (a_name, b_name))
        term = LoraTerm(info("A", a.shape), info("B", b.shape), rank=4, scale=6 / 2, transposed=transposed)
        base = np.random.default_rng(0).standard_normal(delta.shape).astype(np.float32)
        for box in boxes(delta.shape):
            want = (base + delta)[tuple(slice(s, e) for s, e in box)]
            np.testing.assert_allclose(merge_box(term, base, a, b, box), want, rtol=1e-5, atol=1e-5)


def test_terms_add_in_float32_over_a_bf16_base():
    import ml_dtypes

    rng = np.random.default_rng(0)
    base = rng.standard_normal((6, 10)).astype(ml_dtypes.bfloat16)
    factors = {n: rng.standard_normal(s).astype(np.float32) for n, s in
               {"A0": (2, 10), "B0": (6, 2), "A1": (3, 10), "B1": (6, 3)}.items()}
    terms = (LoraTerm(info("A0", (2, 10)), info("B0", (6, 2)), 2, 0.5),
             LoraTerm(info("A1", (3, 10)), info("B1", (6, 3)), 3, 2.0))
    base_info = TensorInfo("w", base.dtype, base.shape, "f", 0, base.nbytes)
    tensor = AdaptedTensor(base_info, terms)
    box = ((1, 5), (3, 9))
    got = tensor.decode(read({"w": base, **factors}, tensor.part_boxes(box)), box)
    want = base.astype(np.float32) + 0.5 * factors["B0"] @ factors["A0"] + 2.0 * factors["B1"] @ factors["A1"]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want[1:5, 3:9], rtol=1e-6)
    parts = tensor.part_boxes(box)
    assert parts["lora0.A"][1] == ((0, 2), (3, 9)) and parts["lora1.B"][1] == ((1, 5), (0, 3))
    assert tensor.nbytes == base.nbytes + sum(f.nbytes for f in factors.values())
