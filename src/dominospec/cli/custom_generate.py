"""`dominospec custom-generate`: make a drafter usable as transformers' `custom_generate="DIR"`."""

from __future__ import annotations

from ..integrations.transformers import write_custom_generate
from ..log import log


def cmd_custom_generate(args) -> int:
    path = write_custom_generate(args.drafter, args.out)
    root = path.parent.parent
    print(path)
    log(f'use it: model.generate(**inputs, custom_generate="{root}", trust_remote_code=True, max_new_tokens=128)')
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "custom-generate",
        help="write custom_generate/generate.py so transformers' generate() decodes with a drafter",
        description="Write OUT/custom_generate/generate.py: then model.generate(**inputs, "
        'custom_generate="OUT", trust_remote_code=True) runs Domino speculative decoding with DRAFTER '
        "(offline; transformers executes that file, hence trust_remote_code).",
    )
    p.add_argument("drafter", help="drafter directory, or lookup (prompt lookup, no trained drafter)")
    p.add_argument("--out", default=None, help="directory to write custom_generate/ into (default: DRAFTER)")
    p.set_defaults(func=cmd_custom_generate)
