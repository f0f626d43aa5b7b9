"""Refuse `--template-kwargs` that cannot change what the import renders, naming each one.

The import renders finished conversations (`add_generation_prompt=False`). A keyword the chat
template never reads is a typo; one it reads only under `{% if add_generation_prompt %}` (Qwen3's
`enable_thinking`, which only writes the empty think block of a *generation prompt*) has no
effect on training rows. Accepting either would give a byte-identical store while the user
believes the option worked, so both are refused before any row is read.
"""

from __future__ import annotations

from typing import Any

SET_BY_IMPORT = ("messages", "tools", "documents", "add_generation_prompt")


def inert_template_kwargs(templates: list[str], kwargs: dict[str, Any]) -> list[str]:
    """One reason per keyword that cannot change the rendering (empty when all can)."""
    from jinja2 import nodes
    from transformers.utils.chat_template_utils import _compile_jinja_template

    everywhere: set[str] = set()
    reachable: set[str] = set()
    for source in templates:
        tree = _compile_jinja_template(source).environment.parse(source)
        everywhere |= {n.name for n in tree.find_all(nodes.Name) if n.ctx == "load"}
        _reachable_names(tree, reachable)
    problems = []
    for key in kwargs:
        if key in SET_BY_IMPORT:
            problems.append(f"{key!r} is set by the import itself (from the data), not a kwarg")
        elif key not in everywhere:
            problems.append(f"{key!r} is never read by the chat template")
        elif key not in reachable:
            problems.append(
                f"{key!r} is read only under add_generation_prompt, i.e. when rendering a "
                "generation prompt; training rows are finished conversations, so it cannot "
                "change the store"
            )
    return problems


def _reachable_names(node: Any, out: set[str]) -> None:
    """Names read by the template when add_generation_prompt is false."""
    from jinja2 import nodes

    if isinstance(node, nodes.If) and _is_generation_prompt(node.test):
        for child in [*node.elif_, *node.else_]:
            _reachable_names(child, out)
        return
    if isinstance(node, nodes.Name) and node.ctx == "load":
        out.add(node.name)
    for child in node.iter_child_nodes():
        _reachable_names(child, out)


def _is_generation_prompt(test: Any) -> bool:
    from jinja2 import nodes

    return isinstance(test, nodes.Name) and test.name == "add_generation_prompt"
