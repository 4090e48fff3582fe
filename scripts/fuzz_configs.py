"""Fuzz ``config.json`` files and safetensors headers of real tiny checkpoints (every family) through
config validation, planning and, where it plans, a load whose every weight is checked.

Usage (from the repository root)::

    JAX_PLATFORMS=cpu .venv/bin/python scripts/fuzz_configs.py [--cases 10000] [--workdir DIR]

Each case is a real family config mutated by hypothesis (types swapped, huge, negative or zero values,
fields removed or added, values nested, another family's ``model_type``, JSON text corrupted) and, for
about a quarter of the cases, a checkpoint whose tensors were renamed (layer and expert indices),
dropped, added, reshaped or copied to a layer past the last. The cases are derandomized, so a given
``--cases`` always runs the same ones. Every outcome must be a typed ``OtfloadError`` or a load whose
leaves equal the checkpoint's tensors through the plan's hooks (read from the files with the
``safetensors`` package) with no leaf read from a fallback key; none may take longer than 10 s. For
each case the outcome, the time and the process's peak RSS are recorded; a summary table is printed.
Exit status 1 if any case failed.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import resource
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np  # noqa: E402
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# Every family's tiny checkpoint kind (registered by the family test modules).
KINDS = ("llama", "mistral", "qwen2", "qwen3", "llama_tied", "mixtral", "qwen3_moe", "gpt_oss", "deepseek_v2",
         "deepseek_v3", "gemma2", "gemma3_text", "gemma3_multimodal")
# The promise checked: every case ends (typed error or verified load) within this.
CASE_LIMIT_S = 10.0
# Fields some family reads that a tiny config may not hold: mutations also add them.
EXTRA_FIELDS = ("head_dim", "rope_scaling", "rope_theta", "num_experts", "num_local_experts", "layer_types",
                "sliding_window_pattern", "mlp_only_layers", "moe_layer_freq", "num_nextn_predict_layers",
                "use_sliding_window", "text_config", "q_lora_rank", "hidden_activation", "attention_bias",
                "mlp_bias", "use_bidirectional_attention", "rope_local_base_freq", "decoder_sparse_step",
                "first_k_dense_replace", "n_group", "topk_group", "swiglu_limit", "final_logit_softcapping")
NAMES = ["", "no", "true", "3", "silu", "swish", "gelu", "gelu_pytorch_tanh", "relu", "default", "linear",
         "llama3", "yarn", "dynamic", "longrope", "llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe",
         "gpt_oss", "deepseek_v2", "deepseek_v3", "gemma2", "gemma3", "gemma3_text", "sliding_attention",
         "full_attention", "chunked_attention", "greedy", "group_limited_greedy", "noaux_tc", "x" * 300]
HUGE = [10**6, 10**9, 2**31, 2**63, 2**64, 10**30, 10**300, 1e9, 1e30, 1e308, float("inf")]
SMALL_INTS = [0, 1, 2, 3, 4, 5, 7, 8, 15, 16, 31, 32, 63, 64, 127, 128, 255, 256, 257, 1024, 1025]
ODD = [None, True, False, [], {}, [1], [None], {"a": 1}, float("nan"), -0.0, 0.5, 1e-300]


def deep(depth: int) -> object:
    value: object = []
    for _ in range(depth):
        value = [value]
    return value


hostile_values = st.one_of(
    st.sampled_from(SMALL_INTS + HUGE + ODD + NAMES),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=6),
    st.integers(1, 60).map(deep),
)
CONFIG_OPS = ("delete", "type_swap", "huge", "negative", "zero", "random", "perturb", "nest", "add")
HEADER_OPS = ("drop", "rename_index", "add", "reshape", "copy_layer")
TEXT_OPS = ("non_object", "model_type", "duplicate_key", "truncate", "digits", "deep_nesting", "bom", "not_utf8")


# --- mutations -------------------------------------------------------------------------------------


def paths(value: object, prefix: tuple = (), depth: int = 3) -> Iterator[tuple]:
    """Every path (dict keys and list indices) into ``value``, to ``depth`` levels."""
    if depth == 0:
        return
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield (*prefix, key)
        yield from paths(child, (*prefix, key), depth - 1)


def get_at(root: object, path: tuple) -> object:
    for key in path:
        root = root[key]
    return root


def set_at(root: object, path: tuple, value: object, delete: bool = False) -> None:
    parent = get_at(root, path[:-1])
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value


def swapped(value: object, draw: Callable) -> object:
    """``value`` in another JSON type that reads alike to a lenient parser."""
    if isinstance(value, bool):
        return draw(st.sampled_from([int(value), str(value).lower(), "yes" if value else "no", [value]]))
    if isinstance(value, int):
        return draw(st.sampled_from([float(value), str(value), bool(value), [value], {"value": value}]))
    if isinstance(value, float):
        return draw(st.sampled_from([int(value) if math.isfinite(value) else 0, str(value), [value]]))
    if isinstance(value, str):
        return draw(st.sampled_from([[value], value.upper(), value + " ", {"name": value}, 1]))
    if isinstance(value, list):
        return draw(st.sampled_from([{str(i): v for i, v in enumerate(value)}, json.dumps(value), len(value)]))
    if isinstance(value, dict):
        return draw(st.sampled_from([list(value.values()), json.dumps(value), list(value)]))
    return draw(hostile_values)


def perturbed(value: object, draw: Callable) -> object:
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return draw(st.sampled_from([value + 1, value - 1, value * 2, value // 2, value * 1000, value + 10**6]))
    if isinstance(value, float):
        return draw(st.sampled_from([value * 10, value / 10, -value, value + 1]))
    if isinstance(value, list):
        return draw(st.sampled_from([value[:-1], value + value[-1:], value[::-1], value + ["chunked_attention"],
                                     value * 2]))
    if isinstance(value, str):
        return draw(st.sampled_from(NAMES))
    return draw(hostile_values)


def mutate_config(config: dict, op: str, draw: Callable) -> None:
    """Apply one mutation ``op`` to ``config`` in place."""
    if op == "add":
        name = draw(st.sampled_from(EXTRA_FIELDS))
        target = config["text_config"] if isinstance(config.get("text_config"), dict) and draw(st.booleans()) \
            else config
        target[name] = draw(hostile_values | st.sampled_from([{"rope_type": "yarn", "factor": 2.0}, [0, 1]]))
        return
    options = list(paths(config))
    if not options:
        config["model_type"] = draw(hostile_values)
        return
    path = draw(st.sampled_from(options))
    value = get_at(config, path)
    if op == "delete":
        set_at(config, path, None, delete=True)
        return
    new = {
        "type_swap": lambda: swapped(value, draw),
        "huge": lambda: draw(st.sampled_from(HUGE)),
        "negative": lambda: -abs(value) if type(value) in (int, float) and value else -1,
        "zero": lambda: draw(st.sampled_from([0, 0.0, "", [], {}, False])),
        "random": lambda: draw(hostile_values),
        "perturb": lambda: perturbed(value, draw),
        "nest": lambda: draw(st.sampled_from([[value], {"value": value}, [[[[value]]]]])),
    }[op]()
    set_at(config, path, new)


def config_text(config: dict, op: str, draw: Callable) -> bytes:
    """``config`` as JSON text damaged by ``op`` (or another JSON value than an object)."""
    text = json.dumps(config)
    if op == "non_object":
        return json.dumps(draw(st.sampled_from([[config], "config", 3, None, []]))).encode()
    if op == "model_type":
        return json.dumps({**config, "model_type": draw(st.sampled_from(NAMES[15:28] + [7, None, ["llama"]]))}).encode()
    if op == "duplicate_key":
        return (text[:-1] + ', "num_hidden_layers": 1000000}').encode()
    if op == "truncate":
        return text[: draw(st.integers(0, len(text) - 1))].encode()
    if op == "digits":
        return text.replace('"num_hidden_layers": ', '"num_hidden_layers": ' + "9" * 5000, 1).encode()
    if op == "deep_nesting":
        return ('{"rope_scaling": ' + "[" * 100_000 + "]" * 100_000 + "}").encode()
    if op == "bom":
        return "\ufeff".encode() + text.encode()
    return text.encode().replace(b'"', b'"\xff', 1)


@dataclass
class Case:
    kind: str
    scan_layers: bool
    config: bytes
    header_ops: list = field(default_factory=list)
    labels: tuple[str, ...] = ("valid",)  # the mutation classes applied


@st.composite
def cases(draw, base_configs: dict[str, dict]) -> Case:
    """One fuzz case: a kind, a mutated config.json and, a quarter of the time, mutated tensors."""
    kind = draw(st.sampled_from(sorted(base_configs)))
    config = copy.deepcopy(base_configs[kind])
    labels = []
    if draw(st.integers(0, 19)) == 0:
        op = draw(st.sampled_from(TEXT_OPS))
        text = config_text(config, op, draw)
        labels.append(f"text:{op}")
    else:
        for op in draw(st.lists(st.sampled_from(CONFIG_OPS), min_size=0, max_size=3)):
            mutate_config(config, op, draw)
            labels.append(f"config:{op}")
        text = json.dumps(config).encode()
    header_ops = []
    if draw(st.integers(0, 3)) == 0:
        header_ops = [(op, draw(st.integers(0, 2**32))) for op in draw(st.lists(st.sampled_from(HEADER_OPS),
                                                                                 min_size=1, max_size=2))]
        labels += [f"header:{op}" for op, _ in header_ops]
    return Case(kind, draw(st.booleans()), text, header_ops, tuple(dict.fromkeys(labels)) or ("valid",))


# --- checkpoints -----------------------------------------------------------------------------------


def tensors_of(path: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def mutate_tensors(tensors: dict[str, np.ndarray], op: str, seed: int) -> None:
    """Apply one structural header mutation to ``tensors`` in place (names and shapes, never values
    of a tensor that keeps its name and shape)."""
    import re

    rng = np.random.default_rng(seed)
    names = sorted(tensors)
    name = names[rng.integers(len(names))]
    indexed = [n for n in names if re.search(r"\.\d+\.", n)]
    if op == "drop":
        del tensors[name]
    elif op == "rename_index" and indexed:
        old = indexed[rng.integers(len(indexed))]
        numbers = list(re.finditer(r"\.(\d+)\.", old))
        m = numbers[rng.integers(len(numbers))]
        new_index = str(rng.choice(["3", "4", "7", "64", "1000000", "99999999999999999", "9" * 40, "03"]))
        tensors[old[: m.start(1)] + new_index + old[m.end(1):]] = tensors.pop(old)
    elif op == "add":
        extra = rng.choice(["model.layers.1000000.self_attn.q_proj.weight", "model.layers.3.input_layernorm.weight",
                            "lm_head.weight", "model.layers.0.mlp.experts.99.w1.weight", "x" * 1000,
                            "model.layers.0.block_sparse_moe.experts.4.w2.weight", "model.layers.-1.x"])
        tensors[str(extra)] = np.zeros((2,), np.float32)
    elif op == "reshape":
        shape = list(tensors[name].shape) or [1]
        axis = int(rng.integers(len(shape)))
        shape[axis] = max(0, shape[axis] + int(rng.choice([-1, 1, shape[axis]])))
        tensors[name] = np.zeros((*shape, 1) if rng.integers(2) else tuple(shape), np.float32)
    elif op == "copy_layer":
        layers = sorted({int(m.group(1)) for n in names if (m := re.search(r"layers\.(\d+)\.", n))})
        if layers:
            last, to = layers[-1], layers[-1] + int(rng.choice([1, 2, 50]))
            for n in names:
                if f"layers.{last}." in n:
                    tensors[n.replace(f"layers.{last}.", f"layers.{to}.")] = tensors[n]


# --- one case --------------------------------------------------------------------------------------


class CaseTimeout(Exception):
    """A case ran past :data:`CASE_LIMIT_S` (raised by SIGALRM in the main thread)."""


def _alarm(signum, frame):
    raise CaseTimeout


@dataclass
class Outcome:
    outcome: str  # an OtfloadError class name, "loaded", or a failure: "CRASH:<type>", "WRONG", "SLOW"
    seconds: float
    peak_rss_mb: float
    detail: str = ""

    @property
    def ok(self) -> bool:
        return not self.outcome.startswith(("CRASH", "WRONG", "SLOW"))


def verify_load(model, path: Path, scan_layers: bool, hf: dict[str, np.ndarray]) -> str:
    """"" when every leaf of ``model`` equals its plan applied to the file tensors ``hf`` and reads
    only the rule's own keys (no fallback); else what differs."""
    from flax import nnx

    import otfload
    from otfload.plan.abstract import dotted
    from otfload.plan.hooks import run_forward
    from otfload.plan.mapping import format_key, slice_values

    _, plan, src = otfload.plan_model(path, scan_layers=scan_layers)
    src.close()
    config = model.cfg.to_dict()
    params = {dotted(p): np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    if set(params) != set(plan.leaves):
        return f"leaves {sorted(set(params) ^ set(plan.leaves))[:3]} differ from the plan"
    for leaf_path, lp in plan.leaves.items():
        fixed, _ = lp.rule.match(leaf_path)
        own = [format_key(lp.rule.source, v) for _, v in slice_values(lp.rule, fixed, lp.stack_axes,
                                                                      lp.stack_shape, config)]
        if [s.name for s in lp.sources] != own:
            return f"{leaf_path} reads {[s.name for s in lp.sources][:2]} instead of {own[:2]}"
        parts = [run_forward(lp.hooks, hf[s.name]) for s in lp.sources]
        want = (np.stack(parts).reshape(lp.leaf.shape) if lp.stack_axes else parts[0]).astype(lp.leaf.dtype)
        if not np.array_equal(params[leaf_path], want):
            return f"{leaf_path} differs from its tensors"
    return ""


def run_case(case: Case, bases: dict[str, Path], base_tensors: dict[str, dict], workdir: Path) -> Outcome:
    """Write the case's checkpoint, load it, classify and verify the outcome."""
    import otfload
    from otfload.errors import OtfloadError

    if case.header_ops:
        path = workdir / "case"
        shutil.rmtree(path, ignore_errors=True)
        path.mkdir()
        hf = dict(base_tensors[case.kind])
        for op, seed in case.header_ops:
            mutate_tensors(hf, op, seed)
        from safetensors.numpy import save_file

        save_file(hf, path / "model.safetensors", metadata={"format": "pt"})
    else:
        path, hf = bases[case.kind], base_tensors[case.kind]
    (path / "config.json").write_bytes(case.config)
    signal.signal(signal.SIGALRM, _alarm)
    signal.setitimer(signal.ITIMER_REAL, CASE_LIMIT_S)
    start = time.perf_counter()
    detail = ""
    try:
        model = otfload.from_pretrained(path, scan_layers=case.scan_layers)
        seconds = time.perf_counter() - start
        signal.setitimer(signal.ITIMER_REAL, 0)
        detail = verify_load(model, path, case.scan_layers, hf)
        outcome = "WRONG" if detail else "loaded"
    except CaseTimeout:
        seconds, outcome = time.perf_counter() - start, "SLOW"
    except OtfloadError as e:
        seconds, outcome, detail = time.perf_counter() - start, type(e).__name__, str(e)[:200]
    except Exception as e:  # noqa: BLE001 - an untyped error is what this fuzzer looks for
        seconds, outcome, detail = time.perf_counter() - start, f"CRASH:{type(e).__name__}", repr(e)[:300]
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    if seconds > CASE_LIMIT_S and outcome in ("loaded",):
        outcome = "SLOW"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return Outcome(outcome, seconds, peak, detail)


# --- the run ---------------------------------------------------------------------------------------


@dataclass
class Fuzzer:
    """Runs cases against base checkpoints and records every outcome."""

    bases: dict[str, Path]
    workdir: Path
    results: list[tuple[Case, Outcome]] = field(default_factory=list)

    def __post_init__(self):
        self.base_tensors = {k: tensors_of(p) for k, p in self.bases.items()}
        self.base_configs = {k: json.loads((p / "config.json").read_text()) for k, p in self.bases.items()}

    def run(self, n: int, *, raise_on_failure: bool = False) -> None:
        """Run ``n`` derandomized cases; with ``raise_on_failure`` the first failing case fails
        (hypothesis then shrinks it), otherwise failures are only recorded."""
        base_text = {k: (p / "config.json").read_bytes() for k, p in self.bases.items()}

        @settings(max_examples=n, derandomize=True, database=None, deadline=None, phases=[Phase.generate]
                  + ([Phase.shrink] if raise_on_failure else []), suppress_health_check=list(HealthCheck))
        @given(cases(self.base_configs))
        def one(case: Case) -> None:
            try:
                outcome = run_case(case, self.bases, self.base_tensors, self.workdir)
            finally:
                for kind, path in self.bases.items():  # the next case starts from the real config
                    (path / "config.json").write_bytes(base_text[kind])
            self.results.append((case, outcome))
            if raise_on_failure:
                assert outcome.ok, (case.labels, case.kind, outcome, case.config[:300], case.header_ops)

        one()

    def failures(self) -> list[tuple[Case, Outcome]]:
        return [(c, o) for c, o in self.results if not o.ok]

    def summary(self) -> str:
        """Markdown tables: cases per mutation class (a case with several mutations counts in each of
        their classes) and their outcomes, then cases per outcome."""
        by_class: dict[str, Counter] = defaultdict(Counter)
        slowest: dict[str, float] = defaultdict(float)
        for case, o in self.results:
            for label in case.labels:
                by_class[label][o.outcome] += 1
                slowest[label] = max(slowest[label], o.seconds)
        lines = ["| mutation class | cases | outcomes | max time (s) |", "|---|---:|---|---:|"]
        for label in sorted(by_class):
            counts = by_class[label]
            shown = ", ".join(f"{k} {v}" for k, v in counts.most_common())
            lines.append(f"| {label} | {sum(counts.values())} | {shown} | {slowest[label]:.2f} |")
        per_outcome: dict[str, list[float]] = defaultdict(list)
        for _, o in self.results:
            per_outcome[o.outcome].append(o.seconds)
        lines += ["", "| outcome | cases | max time (s) | mean time (ms) |", "|---|---:|---:|---:|"]
        for outcome, times in sorted(per_outcome.items(), key=lambda kv: -len(kv[1])):
            lines.append(f"| {outcome} | {len(times)} | {max(times):.2f} | {1000 * sum(times) / len(times):.1f} |")
        times = [o.seconds for _, o in self.results]
        peaks = [o.peak_rss_mb for _, o in self.results]
        lines += ["", f"cases {len(self.results)}, failures {len(self.failures())}, max time {max(times):.2f} s, "
                      f"peak RSS {max(peaks):.0f} MB (after the first case {peaks[0]:.0f} MB)"]
        return "\n".join(lines)


def build_bases(root: Path) -> dict[str, Path]:
    """The tiny checkpoint of every kind under ``root`` (built with transformers once, then reused)."""
    import tests.config.support  # noqa: F401  (registers the family kinds)
    from tests.helpers import save_tiny_hf_model

    bases = {}
    for kind in KINDS:
        path = root / kind
        if not (path / "config.json").exists():
            shutil.rmtree(path, ignore_errors=True)
            save_tiny_hf_model(kind, path)
        bases[kind] = path
    return bases


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=10_000)
    parser.add_argument("--workdir", type=Path, help="where the tiny checkpoints are built (default: a temp dir)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="otfload-fuzz-"))
    fuzzer = Fuzzer(build_bases(workdir / "bases"), workdir)
    start = time.perf_counter()
    fuzzer.run(args.cases)
    print(fuzzer.summary())
    print(f"wall time {time.perf_counter() - start:.0f} s")
    for case, outcome in fuzzer.failures()[:20]:
        print("FAILED", case.labels, case.kind, case.header_ops, outcome, case.config[:200], file=sys.stderr)
    return 1 if fuzzer.failures() else 0


if __name__ == "__main__":
    sys.exit(main())
