"""``otfload eval`` measured on this machine, and projected to real models on real meshes.

    python -m benchmarks.bench_eval --preset tiny              # measure: one `otfload eval` run
    python -m benchmarks.bench_eval --preset small --texts 16 --len 256
    python -m benchmarks.bench_eval --project                  # the real-mesh projection table

Measuring: a synthetic Llama-shaped bf16 checkpoint (random weights, ``benchmarks.make_checkpoint``),
a BPE ``tokenizer.json`` trained with the ``tokenizers`` library on Python's standard-library
sources (so real text goes through a real tokenizer), and a JSONL file of ``--texts`` texts that
each tokenize to more than ``--len`` ids, then ``otfload eval ... --max-len LEN --json`` runs in a
child process on one CPU device (no simulated devices). Printed: the eval's own figures (load
seconds, compile seconds, predicted tokens/s of scoring) and the child's peak RSS
(``getrusage(RUSAGE_CHILDREN)``), one Markdown row.

Projecting: parameter bytes per device (fully sharded), KV-cache bytes per token, forward FLOPs per
token (2 per multiply-add of every active matmul weight, lm_head included, plus causal attention:
``layers · heads · (d_qk + d_v) · s`` at sequence length ``s``, a token seeing ``s / 2`` keys on
average), the f32 logits of one sequence, and the time to score 1e9 tokens at the accelerator's
published dense bf16 peak times ``--mfu``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from benchmarks import harness
from benchmarks.make_checkpoint import Dims, ensure_written

ROOT = Path("bench_data") / "eval"
PRESETS = {
    "tiny": Dims(hidden=512, intermediate=1024, layers=2, vocab=8000),  # 13 M parameters
    "small": Dims(hidden=1024, intermediate=2816, layers=8, vocab=32000),  # 160 M parameters
    "medium": Dims(hidden=2048, intermediate=5632, layers=16, vocab=32000),  # 853 M parameters
    "1b": Dims(hidden=2048, intermediate=5632, layers=22, vocab=32000, heads=32, kv_heads=4,
               head_dim=64),  # TinyLlama-1.1B's shape: issue 31's GPU job
}
TOKENIZER_VOCAB = 8000  # trained BPE size (capped by the model's vocabulary)
CORPUS_PACKAGES = ("json", "argparse", "email", "asyncio", "logging", "unittest")


def corpus_lines() -> list[str]:
    """Non-blank lines of some standard-library packages' sources: plenty of real text, same everywhere."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    lines = []
    for package in CORPUS_PACKAGES:
        for path in sorted((stdlib / package).rglob("*.py")):
            lines += [line.strip() for line in path.read_text(encoding="utf-8", errors="replace").splitlines()]
    return [line for line in lines if line]


def write_tokenizer_config(directory: Path) -> None:
    """A ``tokenizer_config.json`` naming the BPE tokenizer's special tokens, which transformers'
    ``AutoTokenizer`` (and lm_eval's backends) read beside ``tokenizer.json``."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "clean_up_tokenization_spaces": False}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def build_tokenizer(path: Path, vocab: int, lines: list[str]) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=min(vocab, TOKENIZER_VOCAB), special_tokens=["<unk>", "<s>", "</s>"],
                                  show_progress=False)
    tokenizer.train_from_iterator(lines, trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                             special_tokens=[("<s>", tokenizer.token_to_id("<s>"))])
    tokenizer.save(str(path))


def build(preset: str, texts: int, length: int) -> tuple[Path, Path]:
    """``(checkpoint dir with tokenizer.json, data.jsonl)``, written once per preset and shape."""
    dims = PRESETS[preset]
    out = ensure_written(ROOT / preset, dims)
    lines = corpus_lines()
    if not (out / "tokenizer.json").exists():
        build_tokenizer(out / "tokenizer.json", dims.vocab, lines)
    data = out / f"data-{texts}x{length}.jsonl"
    words_per_text = 2 * length  # a BPE token is at most a word here: each text passes --len ids
    words = " ".join(lines).split()
    with open(data, "w") as f:
        for i in range(texts):
            start = (i * words_per_text) % max(1, len(words) - words_per_text)
            f.write(json.dumps({"text": " ".join(words[start : start + words_per_text])}) + "\n")
    return out, data


def measure(args: argparse.Namespace) -> None:
    checkpoint, data = build(args.preset, args.texts, args.len)
    command = [sys.executable, "-m", "otfload.cli", "eval", str(checkpoint), "--data", str(data), "--max-len",
               str(args.len), "--batch-size", str(args.batch_size), "--json", "--no-progress"]
    if args.dtype:
        command += ["--dtype", args.dtype]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device: the real machine
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        sys.exit(out.stderr)
    result = json.loads(out.stdout)
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    dims = PRESETS[args.preset]
    params = dims.nbytes // 2
    dtype = args.dtype or "bfloat16"
    columns = ["preset", "parameters", "dtype", "texts × ids", "batch", "load s", "compile s", "tokens/s", "peak RSS"]
    row = [args.preset, f"{params / 1e6:.0f} M", dtype, f"{args.texts} × {args.len}", args.batch_size,
           f"{result['load_seconds']:.2f}", f"{result['compile_seconds']:.1f}", f"{result['tokens_per_second']:.0f}",
           f"{peak / harness.GIB:.2f} GiB"]  # fmt: skip
    print(harness.table(columns, [row], left=3))
    print(f"nll per token {result['nll_per_token']:.3f}, {result['tokens']} predicted tokens, "
          f"eval {result['eval_seconds']:.1f} s")


# --- projections ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    """The shape facts of a published config.json that memory and FLOPs depend on."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int  # dense MLP width, or each expert's width
    vocab: int
    experts: int = 0
    top_k: int = 0
    params: float | None = None  # published totals where the formula does not apply (MLA)
    active: float | None = None
    kv_bytes_token: int | None = None  # per token, all layers, bf16 (MLA caches a latent)
    attn_dims: int | None = None  # per head, query·key dims + value dims (default 2 · head_dim)

    def counts(self) -> tuple[float, float]:
        """``(total parameters, active matmul parameters per token incl. lm_head)``."""
        if self.params is not None:
            return self.params, self.active
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        embed = self.vocab * self.hidden
        if self.experts:
            total = self.layers * (attn + self.experts * mlp + self.hidden * self.experts) + 2 * embed
            active = self.layers * (attn + self.top_k * mlp + self.hidden * self.experts) + embed
        else:
            total = self.layers * (attn + mlp) + 2 * embed
            active = self.layers * (attn + mlp) + embed
        return total, active

    def kv_per_token(self) -> int:
        return self.kv_bytes_token or 2 * self.layers * self.kv_heads * self.head_dim * 2


ARCHS = [  # from the published config.json files
    Arch("Llama-3.1-8B", 4096, 32, 32, 8, 128, 14336, 128256),
    Arch("Llama-3.1-70B", 8192, 80, 64, 8, 128, 28672, 128256),
    Arch("Mixtral-8x7B", 4096, 32, 32, 8, 128, 14336, 32000, experts=8, top_k=2),
    Arch("Qwen3-30B-A3B", 2048, 48, 32, 4, 128, 768, 151936, experts=128, top_k=8),
    # MLA, absorbed as otfload runs it: each of 128 heads attends over the cached latent (kv_lora_rank
    # 512 + rope 64 dims for q·k, 512 for values); published parameter totals
    Arch("DeepSeek-V3", 7168, 61, 128, 1, 192, 2048, 129280, params=671e9, active=37e9,
         kv_bytes_token=61 * (512 + 64) * 2, attn_dims=576 + 512),
]
MESHES = [  # (name, devices, dense bf16 peak FLOP/s per device, memory per device)
    ("8×H100", 8, 989e12, 80e9),
    ("v5p-64 (32 chips)", 32, 459e12, 95e9),
]


def project(seq: int, mfu: float) -> None:
    tokens = 1e9
    print(f"Projection at s = {seq}, MFU {mfu:.0%}, bf16 weights fully sharded, one sequence per device")
    rows = []
    for arch in ARCHS:
        total, active = arch.counts()
        flops = 2 * active + arch.layers * arch.heads * (arch.attn_dims or 2 * arch.head_dim) * seq
        for mesh, n, peak, memory in MESHES:
            rate = n * peak * mfu / flops
            weights = 2 * total / n
            logits = seq * arch.vocab * 4
            fits = "" if weights + logits < memory else " (does not fit)"
            rows.append([arch.name, f"{total / 1e9:.1f} B ({active / 1e9:.1f} B)",
                         f"{arch.kv_per_token() / 1024:.0f} KiB", f"{flops / 1e9:.1f}", mesh,
                         f"{weights / 1e9:.1f} GB{fits}", f"{logits / 1e9:.2f} GB",
                         f"{rate / 1e3:.0f} k", f"{tokens / rate / 3600:.2f} h"])  # fmt: skip
    columns = ["model", "params (active)", "KV / token", "GFLOP / token", "mesh", "weights / device", "logits / seq",
               "tokens/s", "1e9 tokens"]  # fmt: skip
    print(harness.table(columns, rows))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--texts", type=int, default=32)
    parser.add_argument("--len", type=int, default=256, help="ids kept per text (--max-len)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--dtype", help="parameter dtype (default: the checkpoint's bf16)")
    parser.add_argument("--project", action="store_true", help="print the real-mesh projection instead")
    parser.add_argument("--seq", type=int, default=2048, help="projection: sequence length")
    parser.add_argument("--mfu", type=float, default=0.4, help="projection: model FLOPs utilisation")
    args = parser.parse_args(argv)
    if args.project:
        project(args.seq, args.mfu)
    else:
        measure(args)


if __name__ == "__main__":
    main()
