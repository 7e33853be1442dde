"""Record, or compare with its record, what the installed vLLM release offers
kvsan's adapters: the answer to every question their contracts ask (each
hooked method's parameters, each class's attributes, each module that does
not import), in ``tests/vllm_releases/<version>.json``.

tests/test_contract.py checks today's contracts against every recorded
release, so a contract change that a supported release does not meet fails
in the normal suite, without that release installed.  Run with the
release's interpreter (scripts/release_venv.sh makes one):

    /work/venvs/vllm-0.34.0/bin/python scripts/release_facts.py          # write
    /work/venvs/vllm-0.34.0/bin/python scripts/release_facts.py --check  # compare

Exit status 1 on ``--check`` when the record and the installed release differ.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDS = os.path.join(ROOT, "tests", "vllm_releases")


def contracts():
    """Every adapter's contract, the optional ones included."""
    from kvsan.hooks.vllm import (allocator, identity, inputs, owners, quarantine, weights,
                                  worker)

    return [allocator.CONTRACT, identity.CONTRACT, weights.CONTRACT, quarantine.CONTRACT,
            owners.CONTRACT, worker.CONTRACT, worker.CONTRACT_V2, inputs.CONTRACT]


def facts() -> dict:
    from kvsan.hooks import contract
    from kvsan.hooks.vllm import version

    return contract.record(contracts(), version())


def path_for(version: str) -> str:
    return os.path.join(RECORDS, f"{version}.json")


def dumps(got: dict) -> str:
    return json.dumps(got, indent=1, sort_keys=True) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true",
                    help="compare with the record instead of writing it")
    args = ap.parse_args(argv)
    got = facts()
    if not got["vllm"]:
        print("release_facts: no vLLM installed here", file=sys.stderr)
        return 2
    path = path_for(got["vllm"])
    if args.check:
        try:
            with open(path) as f:
                old = json.load(f)
        except FileNotFoundError:
            print(f"release_facts: no record for vLLM {got['vllm']} ({path})", file=sys.stderr)
            return 1
        if old != json.loads(dumps(got)):
            print(f"release_facts: vLLM {got['vllm']} differs from {path}", file=sys.stderr)
            return 1
        print(f"release_facts: vLLM {got['vllm']} matches {path}")
        return 0
    os.makedirs(RECORDS, exist_ok=True)
    with open(path, "w") as f:
        f.write(dumps(got))
    print(f"release_facts: wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
