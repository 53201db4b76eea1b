"""A test-only custom node pack: a string output of the wildcard type many packs declare.

ComfyUI compares a link's output type with the input type by ``!=``; a ``str`` whose ``__ne__`` is always False
(the "AnyType" idiom of popular packs) feeds any input, a combo list included, so ComfyUI's own check that a combo
value is in its list is skipped. The end-to-end tests use it to post names the node itself must refuse.
"""


class AnyType(str):
    def __ne__(self, other):
        return False


class FewStepE2EAnyString:
    CATEGORY = "fewstep_e2e"
    RETURN_TYPES = (AnyType("*"),)
    FUNCTION = "emit"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"value": ("STRING", {"default": ""})}}

    def emit(self, value):
        return (value,)


NODE_CLASS_MAPPINGS = {"FewStepE2EAnyString": FewStepE2EAnyString}
