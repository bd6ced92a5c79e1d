"""Build-and-deploy pipeline: HF checkpoints -> engines -> Triton speculative decoding."""

import sys
from pathlib import Path

__version__ = "0.1.0"

# The build stage is the `specbuild` package in build/specbuild (an install puts it on the path as a top-level
# package). In a source tree (`python -m pipeline` from the root, Triton models whose cwd is the root) this puts
# the tree's own build/ first, so `import specbuild` takes this tree's copy. build/ has no __init__.py: nothing
# named `build` shadows PyPA's build.
_BUILD_DIR = str(Path(__file__).resolve().parent.parent / "build")
if Path(_BUILD_DIR, "specbuild", "__init__.py").is_file() and _BUILD_DIR not in sys.path:
    sys.path.insert(0, _BUILD_DIR)
