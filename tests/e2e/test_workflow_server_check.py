"""workflow_server_check.mismatches, offline: on an /object_info built from our own node table it finds nothing,
it lets a server add combo entries and widgets after ours (what every ComfyUI release does), and it finds each
change that would break a user's load of a shipped workflow. No server needed."""

from __future__ import annotations

import copy

import pytest
import workflow_check as wc
from workflow_server_check import mismatches


def _entry(spec) -> dict:
    """``spec`` as a server's /object_info lists it (combos as [choices, options], inputs in order)."""
    inputs = {"required": {}, "optional": {}}
    for i in spec.inputs:
        inputs["required" if i.required else "optional"][i.name] = [
            list(i.options) if i.type == "COMBO" else i.type,
            dict(i.opts),
        ]
    return {
        "input": inputs,
        "input_order": {section: list(names) for section, names in inputs.items()},
        "output": [t for _, t in spec.outputs],
        "output_name": [n for n, _ in spec.outputs],
    }


@pytest.fixture(scope="module")
def specs():
    return wc.node_specs()


@pytest.fixture
def info(specs):
    return {name: _entry(spec) for name, spec in specs.items()}


def test_our_own_table_fits(info, specs):
    assert mismatches(info, specs) == {"errors": [], "newer": []}


def test_a_newer_server_adding_entries_and_widgets_fits(info, specs):
    info["CLIPLoader"]["input"]["required"]["type"][0].append("ovis")  # as 0.8.0 did
    info["DualCLIPLoader"]["input"]["required"]["type"][0].append("kandinsky5")
    info["UNETLoader"]["input"]["optional"]["new_widget"] = ["BOOLEAN", {"default": False}]
    info["UNETLoader"]["input_order"]["optional"] = ["new_widget"]
    assert mismatches(info, specs) == {"errors": [], "newer": []}


def test_an_older_server_lacking_newer_nodes_reports_them_apart(info, specs):
    # a server before the FLUX.2 klein support: no EmptyFlux2LatentImage, no CLIPLoader type flux2
    del info["EmptyFlux2LatentImage"]
    info["CLIPLoader"]["input"]["required"]["type"][0].remove("flux2")
    found = mismatches(info, specs)
    assert found["errors"] == []
    assert any(e.startswith("EmptyFlux2LatentImage: ") for e in found["newer"]), found
    assert any(e.startswith("CLIPLoader.type: value 'flux2'") for e in found["newer"]), found


def _drop_batch_size(info):
    info["EmptySD3LatentImage"]["input"]["required"].pop("batch_size")
    info["EmptySD3LatentImage"]["input_order"]["required"].remove("batch_size")


@pytest.mark.parametrize(
    "change,expected",
    [
        (lambda i: i.pop("VAEDecode"), "VAEDecode: used by the shipped workflows, not on the server"),
        (
            lambda i: i["CLIPLoader"]["input"]["required"]["type"][0].remove("wan"),
            "CLIPLoader.type: value 'wan'",
        ),
        (
            lambda i: i["FewStepSampler"]["input"]["required"]["steps"][1].update(max=2),
            "FewStepSampler.steps: value",
        ),
        (_drop_batch_size, "EmptySD3LatentImage.batch_size: set by a workflow, not declared by the server"),
        (
            lambda i: i["EmptySD3LatentImage"]["input"]["required"].update(width=["FLOAT", {}]),
            "EmptySD3LatentImage.width: ours INT required=True, server FLOAT",
        ),
        (
            lambda i: i["EmptySD3LatentImage"]["input_order"].update(
                required=["height", "width", "batch_size"]
            ),
            "EmptySD3LatentImage: widgets",
        ),
        (  # a widget followed by a "control after generate" value shifts every later widget value
            lambda i: i["FewStepSampler"]["input"]["required"]["steps"][1].update(
                control_after_generate=True
            ),
            "FewStepSampler: widgets",
        ),
    ],
    ids=["node", "combo", "range", "input", "type", "widget-order", "widget-control"],
)
def test_each_breaking_change_is_found(info, specs, change, expected):
    info = copy.deepcopy(info)
    change(info)
    errors = mismatches(info, specs)["errors"]
    assert any(expected in e for e in errors), errors
