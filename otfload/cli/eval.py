"""``otfload eval``: score a data file with a checkpoint: summed NLL, predicted tokens, perplexity.

Each text is tokenized with the checkpoint's own tokenizer.json (fetched from the same source as the
weights), cut to its first --max-len ids and scored on its own: every id after the first is
predicted from those before it. Data: a .jsonl/.ndjson file holds one {"text": ...} object per line
(blank lines ignored); any other file holds one text per line. Empty and one-token texts predict
nothing and are counted as skipped. A progress bar goes to stderr; --json prints one object.
Compiled executables are kept for the next job (--compile-cache).
"""

from __future__ import annotations

import argparse
import json

from otfload.cli import options
from otfload.cli.compile_cache import add_compile_cache_arg


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("eval", help="score texts: NLL, tokens, perplexity, tokens/s",
                            description=options.description(__doc__), parents=[options.common_parser()])
    options.add_source_args(p)
    options.add_layout_args(p)
    options.add_load_args(p)
    p.add_argument("--data", required=True, metavar="FILE", help="JSONL ({\"text\": ...} per line) or text file")
    p.add_argument("--format", choices=("auto", "jsonl", "text"), default="auto",
                   help="data format (default: jsonl for .jsonl/.ndjson files, else one text per line)")
    p.add_argument("--text-key", default="text", help="JSONL field holding the text (default: text)")
    p.add_argument("--max-len", type=options.positive_int, metavar="L",
                   help="keep each text's first L ids (default: the config's max_position_embeddings)")
    p.add_argument("--batch-size", type=options.positive_int, default=8, metavar="B",
                   help="texts per forward pass (default: 8)")
    options.add_progress_arg(p)
    add_compile_cache_arg(p)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from otfload.evaluate import evaluate, read_texts

    texts = read_texts(args.data, args.format, args.text_key)  # a bad data file fails before the load
    from otfload.compile_cache import enable_compile_cache

    enable_compile_cache(args.compile_cache)
    options.adapter_as_checkpoint(args)
    result = evaluate(args.source, texts, max_len=args.max_len, batch_size=args.batch_size, progress=args.progress,
                      options=options.load_options(args))
    if args.json:
        print(json.dumps({"source": args.source, "data": args.data, **result.to_dict()}))
    else:
        print(f"{args.source} on {args.data}")
        print(result.summary())
    return 0
