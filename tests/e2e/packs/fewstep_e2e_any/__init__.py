"""A test-only custom node pack: a string (and any JSON value) output of the wildcard type many packs declare.

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


class FewStepE2EAnyJSON:
    """Any JSON value (a number beyond a widget's range, the string "false", a list...) through a wildcard link,
    as another pack's node could deliver it: ComfyUI checks neither its type nor its range."""

    CATEGORY = "fewstep_e2e"
    RETURN_TYPES = (AnyType("*"),)
    FUNCTION = "emit"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"json": ("STRING", {"default": "null"})}}

    def emit(self, json):
        import json as json_module

        return (json_module.loads(json),)


NODE_CLASS_MAPPINGS["FewStepE2EAnyJSON"] = FewStepE2EAnyJSON
