"""Offline validation of ComfyUI workflow files against node definitions (:mod:`.nodes`).

Both formats ComfyUI uses are understood: the API format (``{"<id>": {"class_type", "inputs"}}``, what the
server's /prompt takes) and the UI format (``nodes`` + ``links``, what the frontend's Load opens). Each file
is read into one common graph and checked the way the server would check a prompt: the node classes exist,
required inputs are given, link types match, widget values are in range or in their combo list. UI files
get structural checks on top (widgets_values count, link table consistency).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .nodes import DUMMY_PREFIX, IMAGE_FILE_SUFFIXES, MODEL_FILE_SUFFIXES, InputSpec, NodeSpec, comfy_format


@dataclass
class GraphNode:
    id: str
    class_type: str
    title: str | None = None
    widgets: dict = field(default_factory=dict)  # input name -> value
    links: dict = field(default_factory=dict)  # input name -> (source node id, output slot)


def where(node: GraphNode, input_name: str | None = None) -> str:
    at = f"node {node.id} ({node.class_type})"
    return f"{at} input '{input_name}'" if input_name else at


def is_ui_format(workflow: dict) -> bool:
    return isinstance(workflow.get("nodes"), list) and "links" in workflow


def read_api(workflow: dict) -> tuple[dict[str, GraphNode], list[str]]:
    graph, errors = {}, []
    for node_id, entry in workflow.items():
        if not isinstance(entry, dict) or "class_type" not in entry:
            errors.append(f"node {node_id}: not an API-format node (no class_type)")
            continue
        node = GraphNode(str(node_id), entry["class_type"], entry.get("_meta", {}).get("title"))
        for name, value in entry.get("inputs", {}).items():
            # As in ComfyUI's executor: a [str, int] pair is a link, anything else a value.
            if (
                isinstance(value, list)
                and len(value) == 2
                and isinstance(value[0], str)
                and type(value[1]) is int
            ):
                node.links[name] = (value[0], value[1])
            else:
                node.widgets[name] = value
        graph[node.id] = node
    return graph, errors


def read_ui(workflow: dict, specs: dict[str, NodeSpec]) -> tuple[dict[str, GraphNode], list[str]]:
    graph, errors = {}, []
    links = {}
    for entry in workflow.get("links", []):
        if not (isinstance(entry, list) and len(entry) == 6):
            errors.append(f"links: {entry!r} is not [id, from_node, from_slot, to_node, to_slot, type]")
            continue
        if entry[0] in links:
            errors.append(f"links: duplicate link id {entry[0]}")
        links[entry[0]] = entry
    nodes = workflow["nodes"]
    ids = [n.get("id") for n in nodes]
    if len(set(ids)) != len(ids):
        errors.append(f"nodes: duplicate node ids in {ids}")
    if ids and workflow.get("last_node_id", -1) < max(ids):
        errors.append(f"last_node_id {workflow.get('last_node_id')} is below the largest node id {max(ids)}")
    if links and workflow.get("last_link_id", -1) < max(links):
        errors.append(
            f"last_link_id {workflow.get('last_link_id')} is below the largest link id {max(links)}"
        )
    if "version" not in workflow:
        errors.append("no 'version' key (the frontend rejects the file)")

    frontend = comfy_format()
    for n in nodes:
        node = GraphNode(str(n["id"]), n["type"], n.get("title"))
        values = n.get("widgets_values", [])
        if node.class_type in frontend.NOTE_NODES:
            if not (isinstance(values, list) and len(values) == 1 and isinstance(values[0], str)):
                errors.append(f"{where(node)}: widgets_values must be [text]")
            continue
        if node.class_type in frontend.FRONTEND_ONLY_NODES:
            errors.append(f"{where(node)}: a frontend-only node; the shipped workflows link nodes directly")
            continue
        graph[node.id] = node
        spec = specs.get(node.class_type)
        if spec is None:
            continue  # reported by check_graph
        errors += read_ui_widgets(node, spec, values)
        for slot, inp in enumerate(n.get("inputs", [])):
            errors += read_ui_input(node, spec, slot, inp, links)
        errors += check_ui_outputs(node, spec, n.get("outputs", []), links)
    by_id = {str(n["id"]): n for n in nodes}
    for link_id, (_, _, _, dst, dst_slot, _) in links.items():
        inputs = by_id.get(str(dst), {}).get("inputs", [])
        if not (0 <= dst_slot < len(inputs) and inputs[dst_slot].get("link") == link_id):
            errors.append(f"links: link {link_id} ends at node {dst} slot {dst_slot}, which does not list it")
    return graph, errors


def read_ui_widgets(node: GraphNode, spec: NodeSpec, values) -> list[str]:
    widgets = spec.widgets
    if not isinstance(values, list) or len(values) != spec.widget_value_count:
        count = len(values) if isinstance(values, list) else values
        names = [w.name + (f" + {w.companion[0]}" if w.companion else "") for w in widgets]
        return [
            f"{where(node)}: widgets_values has {count} values, expected {spec.widget_value_count}: {names}"
        ]
    errors, values = [], iter(values)
    for w in widgets:
        node.widgets[w.name] = next(values)
        if w.companion:
            what, allowed, _ = w.companion
            extra = next(values)
            if extra not in allowed:
                errors.append(f"{where(node, w.name)}: {what} {extra!r} not in {sorted(allowed)}")
    return errors


def read_ui_input(node: GraphNode, spec: NodeSpec, slot: int, inp: dict, links: dict) -> list[str]:
    name = inp.get("name")
    declared = spec.input(name)
    if declared is None:
        return [f"{where(node, name)}: no such input on {node.class_type}"]
    errors = []
    if inp.get("type") != declared.type:
        errors.append(
            f"{where(node, name)}: slot type {inp.get('type')!r}, the node declares {declared.type!r}"
        )
    if declared.is_widget and inp.get("widget", {}).get("name") != name:
        errors.append(f'{where(node, name)}: a widget input slot needs "widget": {{"name": {name!r}}}')
    link_id = inp.get("link")
    if link_id is None:
        return errors
    link = links.get(link_id)
    if link is None:
        return errors + [f"{where(node, name)}: link {link_id} is not in the links table"]
    _, src, src_slot, dst, dst_slot, link_type = link
    if (str(dst), dst_slot) != (node.id, slot):
        errors.append(f"{where(node, name)}: link {link_id} ends at node {dst} slot {dst_slot}, not here")
    if not types_match(link_type, declared.type):
        errors.append(
            f"{where(node, name)}: link {link_id} has type {link_type!r}, input is {declared.type!r}"
        )
    node.links[name] = (str(src), src_slot)
    node.widgets.pop(name, None)  # a linked widget's stored value is not used
    return errors


def check_ui_outputs(node: GraphNode, spec: NodeSpec, outputs: list, links: dict) -> list[str]:
    errors = []
    if [o.get("type") for o in outputs] != [t for _, t in spec.outputs]:
        errors.append(
            f"{where(node)}: outputs {[o.get('type') for o in outputs]}, the node returns "
            f"{[t for _, t in spec.outputs]}"
        )
    for slot, out in enumerate(outputs):
        for link_id in out.get("links") or []:
            link = links.get(link_id)
            if link is None or (str(link[1]), link[2]) != (node.id, slot):
                errors.append(f"{where(node)}: output {slot} lists link {link_id}, which does not start here")
    return errors


def types_match(received: str, expected: str) -> bool:
    """ComfyUI's rule: '*' matches anything, else the comma-separated type sets must overlap."""
    if received == expected or "*" in (received, expected):
        return True
    return bool({t.strip() for t in str(received).split(",")} & {t.strip() for t in str(expected).split(",")})


def check_value(inp: InputSpec, value) -> str | None:
    """Why ``value`` is not valid for widget ``inp``, or None."""
    if inp.type in ("INT", "FLOAT"):
        number_types = (int,) if inp.type == "INT" else (int, float)
        if isinstance(value, bool) or not isinstance(value, number_types):
            return f"{value!r} is not an {inp.type}"
        lo, hi = inp.opts.get("min"), inp.opts.get("max")
        if lo is not None and value < lo:
            return f"{value} is below the minimum {lo}"
        if hi is not None and value > hi:
            return f"{value} is above the maximum {hi}"
    elif inp.type == "STRING" and not isinstance(value, str):
        return f"{value!r} is not a STRING"
    elif inp.type == "BOOLEAN" and not isinstance(value, bool):
        return f"{value!r} is not a BOOLEAN"
    elif inp.type == "COMBO" and value not in inp.options:
        if not isinstance(value, str):
            return f"{value!r} is not one of {list(inp.options)}"
        if value.startswith(DUMMY_PREFIX):
            presets = [o for o in inp.options if str(o).startswith(DUMMY_PREFIX)]
            return f"unknown dummy preset {value!r}; presets: {presets}"
        # Files are only listed when present on the machine: accept any model (or, for input/, image) file name.
        suffixes = IMAGE_FILE_SUFFIXES if inp.opts.get("model_files") == "input" else MODEL_FILE_SUFFIXES
        if not (inp.is_file_combo and value.lower().endswith(suffixes)):
            expected = "a model file name or one of" if inp.is_file_combo else "not one of"
            return f"{value!r}: {expected} {list(inp.options)}"
    return None


def check_graph(graph: dict[str, GraphNode], specs: dict[str, NodeSpec]) -> list[str]:
    errors = []
    for node in graph.values():
        spec = specs.get(node.class_type)
        if spec is None:
            errors.append(
                f"{where(node)}: unknown node class {node.class_type!r} (not in the pack or CORE_NODES)"
            )
            continue
        for name, value in node.widgets.items():
            inp = spec.input(name)
            if inp is None:
                errors.append(f"{where(node, name)}: no such input on {node.class_type}")
            elif not inp.is_widget:
                errors.append(
                    f"{where(node, name)}: a {inp.type} input must be a link, got the value {value!r}"
                )
            elif (why := check_value(inp, value)) is not None:
                errors.append(f"{where(node, name)}: {why}")
        for name, (src_id, slot) in node.links.items():
            inp = spec.input(name)
            src = graph.get(src_id)
            if inp is None:
                errors.append(f"{where(node, name)}: no such input on {node.class_type}")
            elif src is None:
                errors.append(f"{where(node, name)}: links to node {src_id}, which does not exist")
            elif (src_spec := specs.get(src.class_type)) is None:
                continue  # the source is reported as unknown itself
            elif not 0 <= slot < len(src_spec.outputs):
                errors.append(f"{where(node, name)}: {where(src)} has no output slot {slot}")
            elif not types_match(src_spec.outputs[slot][1], inp.type):
                errors.append(
                    f"{where(node, name)}: expects {inp.type}, linked to {src_spec.outputs[slot][1]} "
                    f"output {slot} of {where(src)}"
                )
        for inp in spec.inputs:
            if inp.required and inp.name not in node.widgets and inp.name not in node.links:
                kind = "value" if inp.is_widget else f"{inp.type} link"
                errors.append(f"{where(node, inp.name)}: required input missing (needs a {kind})")
    return errors


def read_workflow(workflow: dict, specs: dict[str, NodeSpec]) -> tuple[dict[str, GraphNode], list[str]]:
    return read_ui(workflow, specs) if is_ui_format(workflow) else read_api(workflow)


def validate(workflow: dict, specs: dict[str, NodeSpec]) -> list[str]:
    """Every problem found in a UI- or API-format workflow, each naming its node id, class and input."""
    graph, errors = read_workflow(workflow, specs)
    return errors + check_graph(graph, specs)


def compare_twins(ui: dict, api: dict, specs: dict[str, NodeSpec]) -> list[str]:
    """Differences between a UI workflow and its API export (the same nodes, values and links)."""
    ui_graph, _ = read_ui(ui, specs)
    api_graph, _ = read_api(api)
    errors = []
    if set(ui_graph) != set(api_graph):
        errors.append(f"node ids differ: UI {sorted(ui_graph)}, API {sorted(api_graph)}")
    for node_id in sorted(set(ui_graph) & set(api_graph)):
        a, b = ui_graph[node_id], api_graph[node_id]
        for what in ("class_type", "title", "widgets", "links"):
            if getattr(a, what) != getattr(b, what):
                errors.append(f"{where(a)}: {what} differ: UI {getattr(a, what)!r}, API {getattr(b, what)!r}")
    return errors
