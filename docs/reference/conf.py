"""Sphinx configuration of the API reference of the `sorters` package (issue #59).

Built from the docstrings (Google style, read by napoleon) with warnings as errors, nothing downloaded:

    python -m sphinx -W --keep-going -n -b html docs/reference /tmp/sorters-reference

tests/test_reference.py builds it so into a temporary folder and checks that every name of docs/api.md is in it.
"""
import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path.insert(0, ROOT)  # the checkout's package, not an installed copy
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # the reference never needs a GPU

import sorters  # noqa: E402  (after the path above)

project = "cdgrab-sorters"
author = "The CD-GraB reference suite developers"
copyright = "the CD-GraB reference suite developers (MIT licence)"
release = version = sorters.__version__

extensions = ["sphinx.ext.autodoc", "sphinx.ext.napoleon"]
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_default_options = {"members": True, "show-inheritance": True}
autodoc_class_signature = "separated"
exclude_patterns = ["_build"]
html_theme = "alabaster"
html_theme_options = {"nosidebar": False}

# nitpicky: every cross-reference must resolve, except to the libraries the package builds on, whose
# inventories would have to be downloaded (intersphinx), and to annotations of their private types
nitpick_ignore_regex = [
    ("py:.*", r"(torch|numpy|np|numba|transformers|lightning|accelerate|collections\.abc|typing)(\..*)?"),
    ("py:class", r"(Tensor|Module|Dataset|Sampler|Generator|Callable|Iterator|Iterable|Sequence|Mapping)"),
    ("py:class", r"(optional|default.*)"),
    # the public classes' bases and helpers that live in internal modules (every module but the four public
    # ones, docs/api.md): named, not documented
    ("py:class", r"sorters\.(?!(exact|fsdp|hf|lightning)\.)\w+\.\w+"),
]
