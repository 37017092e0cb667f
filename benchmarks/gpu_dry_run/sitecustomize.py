"""Makes this interpreter look like the lent GPU machine's image, which has torch, triton and
transformers but not the serving stack: the packages below are not found, by an import or by
importlib.util.find_spec (transformers probes for peft that way). For a dry run of
gpu_session.sh on a CPU machine (see its header)."""
import sys

ABSENT = {"ray", "hydra", "omegaconf", "xgrammar", "gguf", "peft", "pydantic", "paramiko",
          "jsonschema"}


class _Hiding:
    """One of the interpreter's finders, blind to ABSENT."""

    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ABSENT or not hasattr(self.finder, "find_spec"):
            return None
        return self.finder.find_spec(name, path, target)

    def find_distributions(self, *args, **kwargs):  # importlib.metadata asks the finders too
        if not hasattr(self.finder, "find_distributions"):
            return iter(())
        return self.finder.find_distributions(*args, **kwargs)

    def invalidate_caches(self):
        if hasattr(self.finder, "invalidate_caches"):
            self.finder.invalidate_caches()


sys.meta_path[:] = [_Hiding(finder) for finder in sys.meta_path]
