"""A test-only custom node pack: shows a SIGMAS value in the prompt's history, every float32 exactly.

ComfyUI has no node that outputs a schedule's numbers; the end-to-end tests wire a schedule node (ours or a core
one) into this and read ``outputs[node]["sigmas"]`` from GET /history, to compare schedules as computed inside a
real server.
"""


class FewStepE2ESigmasOut:
    CATEGORY = "fewstep_e2e"
    RETURN_TYPES = ()
    OUTPUT_NODE = True
    FUNCTION = "show"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"sigmas": ("SIGMAS",)}}

    def show(self, sigmas):
        # float32 -> Python float is exact, and JSON writes a float's shortest round-tripping repr
        return {"ui": {"sigmas": [float(s) for s in sigmas.flatten().tolist()], "dtype": [str(sigmas.dtype)]}}


NODE_CLASS_MAPPINGS = {"FewStepE2ESigmasOut": FewStepE2ESigmasOut}
