"""``otfload generate``: greedy continuation of a prompt, for a quick look at a checkpoint.

The prompt is tokenized with the checkpoint's own tokenizer.json (special tokens as its
post-processor adds them), continued greedily with the KV cache (otfload.generate, stopping at the
config's EOS ids) and decoded with the same tokenizer, special tokens left out. Several --prompt
options run as one left-padded batch. Progress bars go to stderr (the load's in bytes, then the new
tokens, the first one after compiling); --json prints one object per prompt.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from otfload.cli import options

if TYPE_CHECKING:
    import numpy as np


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("generate", help="greedy continuation of a prompt (decoded text)",
                            description=options.description(__doc__), parents=[options.common_parser()])
    options.add_source_args(p)
    options.add_layout_args(p)
    options.add_load_args(p)
    p.add_argument("--prompt", action="append", required=True, help="the text to continue (repeat for a batch)")
    p.add_argument("--max-new-tokens", type=options.positive_int, default=32, metavar="N",
                   help="tokens to generate (default: 32)")
    options.add_progress_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object per prompt (ids and text)")
    p.set_defaults(run=run)


def left_padded(rows: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """``(ids, mask)``: the rows padded on the left with id 0 to the longest (mask 0 there)."""
    import numpy as np

    width = max(len(r) for r in rows)
    ids = np.zeros((len(rows), width), np.int32)
    mask = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


def until_eos(ids: list[int], eos: tuple[int, ...]) -> list[int]:
    """``ids`` up to (without) the first EOS id."""
    for i, t in enumerate(ids):
        if t in eos:
            return ids[:i]
    return ids


def run(args: argparse.Namespace) -> int:
    import numpy as np
    from tqdm import tqdm

    from otfload.errors import OtfloadError
    from otfload.evaluate import load_with_tokenizer
    from otfload.generate import generate, special_tokens

    options.adapter_as_checkpoint(args)
    show = sys.stderr.isatty() if args.progress is None else args.progress
    model, tokenizer, seconds = load_with_tokenizer(args.source, options=options.load_options(args), progress=show)
    prompts = [e.ids for e in tokenizer.encode_batch(args.prompt)]
    if not all(prompts):
        raise OtfloadError("a prompt tokenizes to no ids (an empty prompt, and the tokenizer adds no BOS token)")
    ids, mask = left_padded(prompts)
    with tqdm(total=args.max_new_tokens, unit="tok", desc="generate", disable=not show, file=sys.stderr,
              dynamic_ncols=True) as bar:
        def tick(new: np.ndarray) -> bool:  # ``stop``, called after each step: never stops, moves the bar
            bar.update(new.shape[1] - bar.n)
            return False

        out = np.asarray(generate(model, ids, args.max_new_tokens, attention_mask=mask, stop=tick if show else None))
        bar.update(bar.total - bar.n)  # the last step (or an EOS in every row) ends the bar
    eos, _ = special_tokens(model, None, None)
    for text, prompt, row in zip(args.prompt, prompts, out, strict=True):
        new = until_eos(row[ids.shape[1]:].tolist(), eos)
        completion = tokenizer.decode(new, skip_special_tokens=True)
        if args.json:
            print(json.dumps({"prompt": text, "prompt_ids": prompt, "new_ids": new, "completion": completion,
                              "text": tokenizer.decode(prompt + new, skip_special_tokens=True)}))
        else:
            print(tokenizer.decode(prompt + new, skip_special_tokens=True))
    if not args.json:
        print(f"(loaded in {seconds:.2f} s)", flush=True)
    return 0
