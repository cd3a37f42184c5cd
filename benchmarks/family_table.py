"""[main] The family table from the family tests: one row a family build, one column a check, each cell as it ran.

    python benchmarks/family_table.py [--families qwen3_vl_moe,glm4v,...] [--out benchmarks/results/families]

Runs the suites every family build is held to (``tests/test_families.py``: parity on text, one image,
two images and prompts split in pieces, batch invariance, whole prompts prefilled together, the vision
forward and cache; ``tests/test_engine_speculative.py``: ngram drafts; ``tests/test_engine_kv_quant.py``:
``--kv-bits``) filtered to the builds asked for, reads pytest's JUnit report and prints a markdown table:
``exact`` where the test passed, ``off`` where it skipped (the family turns that path off, saying why), and
``FAILED`` where it failed. Writes ``families.xml`` and ``families.md``.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SUITES = ("tests/test_families.py", "tests/test_engine_speculative.py", "tests/test_engine_kv_quant.py")
# Test function -> column; the tests not named here are not family checks.
COLUMNS = {
    "test_greedy_tokens_equal_mlx_vlm_reference": "parity (text, 1 and 2 images, split)",
    "test_batch_invariance_of_eight_mixed_requests": "batch of 8",
    "test_prompts_that_start_together_prefill_together_as_alone": "prefilled together + prefix cache",
    "test_image_prompts_admitted_together_share_one_vision_forward": "vision forward + cache",
    "test_drafts_give_mlx_vlm_greedy_tokens_alone_and_batched": "ngram drafts",
    "test_greedy_tokens_equal_mlx_vlm_quantized_generate_alone_and_batched": "--kv-bits",
}
CELL = {"passed": "exact", "skipped": "off", "failed": "FAILED"}


def run(families: list[str], report: Path) -> None:
    # pytest ids name a build as ``[arch]`` or ``[arch/variant]``; -k cannot hold "/", so select by node id
    wanted = "|".join(re.escape(f) for f in families)
    ids = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", *SUITES], cwd=ROOT, capture_output=True,
                         text=True).stdout.splitlines()
    chosen = [i for i in ids if re.search(rf"\[({wanted})\]$", i) and i.split("::")[1].split("[")[0] in COLUMNS]
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:randomly", f"--junitxml={report}", *chosen],
                   cwd=ROOT, check=False)


def table(report: Path, families: list[str]) -> str:
    cells: dict[tuple[str, str], str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        test, _, build = case.get("name", "").partition("[")
        state = "failed" if case.find("failure") is not None or case.find("error") is not None else \
            "skipped" if case.find("skipped") is not None else "passed"
        cells[(build.rstrip("]"), COLUMNS[test])] = CELL[state]
    columns = list(COLUMNS.values())
    lines = ["| family | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
    lines += [f"| `{f}` | " + " | ".join(cells.get((f, c), "-") for c in columns) + " |" for f in families]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "families")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from vlmserve.testing import FAMILY_BUILDS

    families = args.families.split(",") if args.families else list(FAMILY_BUILDS)
    args.out.mkdir(parents=True, exist_ok=True)
    report = args.out / "families.xml"
    run(families, report)
    text = table(report, families)
    (args.out / "families.md").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
