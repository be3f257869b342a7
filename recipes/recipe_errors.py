"""How a recipe ends on bad input: one line `RECIPE: error: ...` on stderr and exit status 2, as the
`specdec` CLI does (SPECDEC_DEBUG=1 shows the traceback instead); under `accelerate launch` it
ends the process group on the way out."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

from distill.accel import close_process_group
from runtime.errors import SpecdecError


def run(main: Callable[[], object]) -> None:
    """Call `main()`; a ValueError, a missing file or a SpecdecError (runtime.output_paths' refusals
    among them) becomes one line and exit status 2."""
    try:
        main()
    except (ValueError, FileNotFoundError, SpecdecError) as err:
        if os.environ.get("SPECDEC_DEBUG"):
            raise
        name = Path(sys.argv[0]).stem
        print(f"{name}: error: {' '.join(str(err).split())}", file=sys.stderr)
        sys.exit(2)
    finally:
        close_process_group()  # under `accelerate launch`
