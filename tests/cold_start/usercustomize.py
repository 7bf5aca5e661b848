"""On PYTHONPATH for every interpreter the suite starts (tests/conftest.py): torch, torchvision, transformers and
datasets, and their submodules, are imported with Python's cycle collector paused. Their imports build objects that
live as long as the process, which the collector scanned again and again as the heap grew: 714 collections during a
cold `import torch, torchvision` here, 0.3 of its 2.5 CPU-seconds. Once a package's first import is done, what it built
is frozen out of the collector's reach (gc.freeze(), as tools/warm_ranks.py's server does): a full collection then
scans what the program builds, not the 345,000 objects of torch and torchvision (0.23 CPU-s each; a GPT-2 rank of the
phase table spent 0.95 s in the collector, now 0.45). The collector runs as before, and the scripts run as users run
them."""

import gc
import importlib.machinery
import sys

PAUSED = {"torch", "torchvision", "transformers", "datasets"}


class PausedCollector:
    """A finder that finds these packages as the path finder does, their loader's run wrapped."""

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] not in PAUSED:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_paused(module):
            enabled = gc.isenabled()
            gc.disable()
            try:
                exec_module(module)
            finally:
                if enabled:
                    # A package's first import: what it built is left out of later full collections.
                    if module.__name__ in PAUSED:
                        gc.freeze()
                    gc.enable()

        spec.loader.exec_module = exec_paused
        return spec


# just before the path finder: the finders before it (a tool's, an editable install's) still see every import first
sys.meta_path.insert(sys.meta_path.index(importlib.machinery.PathFinder), PausedCollector())
