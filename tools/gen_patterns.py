"""Writes the pre-traced patterns shipped with the package (``ascend_passes/passes/_shipped_patterns.py``):
every search function of every pattern pass traced in this process, as Python source that rebuilds
its ``PatternExpr``, keyed as ``ascend_passes/passes/_shipped.py`` describes.  Run it after
changing a pattern (tests/test_shipped_patterns.py fails until then) or the pinned torch.

    python tools/gen_patterns.py            # (re)write the module
    python tools/gen_patterns.py --check    # exit 1 when the checked-in module differs
"""

from __future__ import annotations

import argparse
import logging
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only compare with the checked-in module")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    from ascend_passes.passes import _shipped

    t0 = time.perf_counter()
    text = _shipped.generate()
    path = _shipped.generated_path()
    old = path.read_text() if path.exists() else None
    seconds = time.perf_counter() - t0
    if args.check:
        if old != text:
            print(f"{path} is not current: run python tools/gen_patterns.py", file=sys.stderr)
            return 1
        print(f"{path} is current ({len(text.encode()) / 1024:.0f} KiB, generated in {seconds:.1f} s)")
        return 0
    path.write_text(text)
    print(f"wrote {path} ({len(text.encode()) / 1024:.0f} KiB, {seconds:.1f} s){'' if old != text else ', unchanged'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
