"""Sphinx configuration: API pages from the docstrings (autosummary, napoleon), guides in MyST, notebooks with their
stored outputs (myst-nb, not executed), math by a local MathJax.

Build with ``make docs`` (warnings are errors). ``generate.py`` writes the generated pages first.
"""

from __future__ import annotations

import pathlib
import sys
from typing import Any

DOCS = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(DOCS))

import generate  # noqa: E402
from sphinx.util import logging  # noqa: E402

import optax_sparse_adam  # noqa: E402

generate.generate()

project = "optax_sparse_adam"
release = version = optax_sparse_adam.__version__
html_title = "optax_sparse_adam"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "myst_nb",
]
templates_path = ["_templates"]
exclude_patterns = ["_build", "**.ipynb_checkpoints", "_generated"]  # _generated: included into pages, not pages
nitpicky = True

# API pages: one per public name, from the docstrings (Google style, math in ``.. math::``).
autosummary_generate = True
autosummary_ignore_module_all = False
# ``bags`` and ``Bags`` would share a file name on a case-insensitive file system.
autosummary_filename_map = {"optax_sparse_adam.bags": "optax_sparse_adam.bags-function"}
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True  # a NamedTuple's "Attributes:" as fields, not a second description of its members
autodoc_inherit_docstrings = False  # flax's own docstrings are not this library's to check

# No inventories of other projects are fetched (the build runs offline), so references to jax, optax, flax, numpy,
# torch and the standard library's typing names are left as text rather than reported as missing. References into
# this library are all checked.
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jnp|optax|flax|nnx|nn|numpy|np|chex|torch|typing|collections|types|enum|dataclasses)(\..*)?"),
    (r"py:.*", r"(Any|Callable|Sequence|Mapping|Iterable|Iterator|Literal|NamedTuple|ArrayLike|DTypeLike)"),
    (r"py:.*", r"(int|float|bool|str|bytes|tuple|list|dict|object|None|type|callable|optional)"),
    (r"py:class", r"(ArrayTree|EpsPlacement|MaskOrFn)"),  # type aliases of optax and of private modules
]
nitpick_ignore: list[tuple[str, str]] = []

# MyST for the guides and the notebooks; the notebooks are shown with the outputs stored in them.
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3
nb_execution_mode = "off"
nb_merge_streams = True

# Math: MathJax 3 served from the site itself (SVG output needs no font files).
mathjax_path = generate.mathjax(generate.OUT)
# An undefined macro is a TeX error (which the browser test finds), not the macro's name drawn in red.
mathjax3_config = {"tex": {"packages": {"[-]": ["noundefined"]}}}
html_static_path = ["_static", str(generate.OUT / "static")]
html_css_files = ["custom.css"]

html_theme = "sphinx_book_theme"
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": False,
    "use_fullscreen_button": False,
}
html_context = {"default_mode": "auto"}
html_show_copyright = False
html_last_updated_fmt = None

logger = logging.getLogger(__name__)


def check_api_is_complete(app: Any, env: Any) -> None:
    """A public name without an API entry fails the build (warnings are errors)."""
    documented = set(env.get_domain("py").objects)
    for name in generate.public_api():
        if name not in documented:
            logger.warning("public name %s has no entry in the API reference (docs/api.rst)", name)


def resolve_in_package(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """A reference the docstrings write relative to the package (``:func:`sparse_adam``` in ``optax_sparse_adam.nnx``)
    resolves to the package's name."""
    target = node.get("reftarget", "")
    if node.get("refdomain") != "py" or target.startswith("optax_sparse_adam"):
        return None
    return env.get_domain("py").resolve_xref(
        env, node["refdoc"], app.builder, node["reftype"], f"optax_sparse_adam.{target}", node, contnode
    )


def setup(app: Any) -> None:
    app.connect("env-check-consistency", check_api_is_complete)
    app.connect("missing-reference", resolve_in_package)
