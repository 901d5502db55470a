"""`edge-agent bundle graph RECIPE --out F.onnx [--param KEY=VALUE ...]`: write one recipe's stage graph.

The parser imports nothing heavy; the recipes (numpy, and onnx) load only when the command runs. It lives
outside the `graphs` package, whose `__init__` imports every recipe: inside it, building the CLI's parser
imported numpy in every `edge-agent` command (88 ms before `run` could start its proof child).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from agent.errors import UsageError


def add_graph_parser(bsub: Any) -> None:
    gp = bsub.add_parser("graph", help="write a pre or post stage graph from a recipe (docs/recipes.md)")
    gp.add_argument("recipe", nargs="?", help="e.g. pre.letterbox, post.yolox (--list shows them all)")
    gp.add_argument("--out", type=Path, help="the .onnx file to write")
    gp.add_argument("--param", action="append", default=[], metavar="KEY=VALUE", help="a recipe parameter (repeatable)")
    gp.add_argument("--input-name", help="pre recipes: the model input the graph feeds (same as --param input_name=)")
    gp.add_argument("--list", action="store_true", help="list the recipes and their parameters")
    gp.set_defaults(func=run_graph)


def run_graph(args: argparse.Namespace) -> int:
    from agent.bundle.graphs import RECIPES, recipe, write_graph
    from agent.bundle.graphs.params import split_params

    if args.list:
        for name in ([args.recipe] if args.recipe else sorted(RECIPES)):
            r = recipe(name)
            print(f"{r.name}: {r.summary}")
            for key, p in r.params.items():
                choices = f" [{'|'.join(p.choices)}]" if p.choices else ""
                print(f"  {key}={_show(p.default)}{choices}  {p.help}")
        return 0
    if not args.recipe or args.out is None:
        raise UsageError("bundle graph: give a RECIPE and --out FILE.onnx (--list shows the recipes)")
    params = split_params(args.param)
    if args.input_name is not None:
        if "input_name" in params:
            raise UsageError("bundle graph: --input-name and --param input_name both given")
        params["input_name"] = args.input_name
    out = write_graph(args.recipe, args.out, params)
    print(f"{out}: {args.recipe}", file=sys.stderr)
    return 0


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ";".join(",".join(str(v) for v in x) for x in value) if value and isinstance(value[0], tuple) \
            else ",".join(str(v) for v in value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def markdown_table(name: str, skip: tuple[str, ...] = ()) -> str:
    """A recipe's parameters as the Markdown table docs/recipes.md carries (a test keeps the two equal)."""
    from agent.bundle.graphs import recipe

    rows = ["| param | default | meaning |", "|---|---|---|"]
    for key, p in recipe(name).params.items():
        if key in skip:
            continue
        choices = f" ({' / '.join(p.choices)})" if p.choices else ""
        default = f"`{_show(p.default)}`" if _show(p.default) else "(none)"
        rows.append(f"| `{key}` | {default} | {p.help}{choices} |")
    return "\n".join(rows)
