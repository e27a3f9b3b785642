"""Sphinx configuration of shmkv's documentation: the pages under docs/ and the API
reference built from the docstrings (``make docs``; ``make test`` builds it too).

Why Sphinx (with autodoc, napoleon and MyST) rather than MkDocs with mkdocstrings: the
docstrings of shmkv are written in reStructuredText, with Sphinx's roles
(``:class:``, ``:meth:``, ``:func:``) throughout; Sphinx renders them as they are and,
run nitpicky (``-n``), checks every one of those references against the documented
names, so a renamed class or a stale ``:meth:`` fails the build instead of rotting.
MyST lets the existing Markdown pages (docs/*.md) be part of the same build without
rewriting them. The build is plain HTML with the stock theme: nothing to install beyond
``sphinx`` and ``myst-parser`` (``./scripts/setup.sh test`` installs both).

The reference documents only shmkv's public names; references into third-party
libraries (torch, numpy, transformers, msgpack) are not checked, since their inventories
are not fetched (the build runs offline): those targets are listed in
``nitpick_ignore`` / ``nitpick_ignore_regex`` below, and only those.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

project = "shmkv"
author = "shmkv maintainers"
copyright = "shmkv maintainers"
release = version = "0.1.0"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",  # the "Args:" / "Returns:" / "Raises:" sections
    "myst_parser",
]
source_suffix = {".rst": "restructuredtext", ".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build"]

# Links in the Markdown pages to files of the repository outside docs/ (results files,
# scripts) are kept as links; headings get anchors so pages can link to sections.
myst_heading_anchors = 3
myst_enable_extensions = ["colon_fence"]

autodoc_default_options = {
    "members": True,
    "member-order": "bysource",
    "show-inheritance": True,
}
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autoclass_content = "both"  # the class docstring and __init__'s (the arguments)
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = True
# "Raises:" entries name their exceptions as prose ("OutOfRange / WrongType: ..."), not
# one type each: render them as written, as a parameter-style list.
napoleon_custom_sections = [("Raises", "params_style")]

nitpicky = True
# Third-party types only (never a shmkv name): their documentation is not fetched.
# Internal names that public docstrings mention but the reference does not document
# (each one by name; nothing else of shmkv may be ignored): ``SequenceTable`` and
# ``PoolMemory`` are the coordinator's bookkeeping and memory (being split into modules
# of their own: to document once that settles), ``BlockPool`` and ``TableWriter`` what
# the sequence table's parts are handed (named by their signatures), ``_spin`` is private.
nitpick_ignore = [
    ("py:class", "shmkv.memory.pool.PoolMemory"),
    ("py:class", "shmkv.coordinator.allocator.BlockPool"),
    ("py:class", "shmkv.memory.tables.TableWriter"),
    ("py:meth", "_spin"),
    # the coordinator's tier machinery (shmkv/tiers/, shmkv/tiers/redis_store.py), named by those
    # modules' docstrings; neither is for users
    ("py:class", "TierSet"),
    ("py:class", "shmkv.tiers.tier_set.TierSet"),  # (as Ops.copy_tiers's return annotation)
    ("py:meth", "TierSet.tick"),
    ("py:class", "RemoteTierSet"),
]
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|np|transformers|msgpack|redis|prometheus_client)(\..*)?"),
    (r"py:class", r"(Tensor|ndarray|socket\.socket|selectors\..*)"),
    (r"py:class", r"array(\.array)?"),  # the standard library's typed arrays
    # typing.Sequence as some modules import it (``Sequence`` is shmkv.coordinator.rows' class)
    (r"py:class", r"Seq"),
]

html_theme = "alabaster"
html_title = "shmkv"
html_show_sourcelink = False


# -- shmkv names by any of their import paths ---------------------------------------------
# The API reference documents each class and function where it is defined
# (``shmkv.client.client.Client``), while docstrings also name them as users import them
# (``shmkv.Client``, ``PoolConfig`` from a module that imports it,
# ``shmkv.memory.pool.storage_view`` kept there for compatibility). An unresolved reference
# to a shmkv name is looked up by importing it and retried under the name of the object it
# is; a reference whose object is not documented under its own name still fails the build.


def _canonical(target: str, modname: str):
    import importlib

    candidates = [target]
    if modname:
        candidates.insert(0, f"{modname}.{target}")
    candidates.append(f"shmkv.{target}")
    for candidate in candidates:
        if not candidate.startswith("shmkv"):
            continue
        parts = candidate.split(".")
        for split in range(len(parts), 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:split]))
            except ImportError:
                continue
            try:
                for attr in parts[split:]:
                    obj = getattr(obj, attr)
            except AttributeError:
                break
            owner = getattr(obj, "__module__", None)
            qualname = getattr(obj, "__qualname__", None)
            if owner and qualname and not isinstance(obj, type(importlib)):
                name = f"{owner}.{qualname}"
                if name != target:
                    return name
            break
    return None


def _resolve_alias(app, env, node, contnode):
    if node.get("refdomain") != "py":
        return None
    target = node.get("reftarget", "")
    canonical = _canonical(target, node.get("py:module") or "")
    if canonical is None:
        return None
    domain = env.get_domain("py")
    return domain.resolve_xref(
        env,
        node.get("refdoc", env.docname),
        app.builder,
        node.get("reftype"),
        canonical,
        node,
        contnode,
    )


# -- links from the Markdown pages to files of the repository outside docs/ ------------------
# ``[results](../benchmarks/results/batch.md)`` in a page must stay a plain relative
# link (it is read on a forge too), but MyST would take a ``.md`` target for a page of
# this build and report it missing. Such links are read as MyST ``path:`` links instead:
# the file is copied next to the HTML and linked, and a link to a file that does not
# exist fails the build.

import re  # noqa: E402

_LINK = re.compile(r"\]\((?![a-zA-Z][\w+.-]*:|#|/)([^()\s#]+)(#[^()\s]*)?\)")


_IMAGES = (".png", ".svg", ".jpg", ".jpeg", ".gif")


def _outside_links(app, docname, source):
    here = os.path.dirname(os.path.join(app.srcdir, docname))
    srcdir = os.path.abspath(app.srcdir)

    def repl(match):
        if match.group(1).lower().endswith(_IMAGES):
            return match.group(0)  # an image: Sphinx copies it, wherever it is
        target = os.path.abspath(os.path.join(here, match.group(1)))
        if target == srcdir or target.startswith(srcdir + os.sep):
            return match.group(0)
        return f"](path:{match.group(1)})"

    if app.env.doc2path(docname).suffix == ".md":
        source[0] = _LINK.sub(repl, source[0])


# -- every page is in the index's toctree -----------------------------------------------
# A page added to docs/ later (docs/vllm.md, say) is put in the index's table of
# contents before the API reference, so that adding a page never fails the build with
# "document isn't included in any toctree"; the index names the pages it orders.


def _every_page_in_toc(app, docname, source):
    if docname != "index":
        return
    listed = set(re.findall(r"^([\w/-]+)$", source[0], flags=re.M))
    pages = sorted(
        os.path.splitext(name)[0]
        for name in os.listdir(app.srcdir)
        if name.endswith((".md", ".rst")) and name not in ("index.md", "README.md")
    )
    missing = [page for page in pages if page not in listed]
    if missing:
        listing = "".join(p + "\n" for p in missing)
        source[0] = source[0].replace("\napi\n", "\n" + listing + "api\n", 1)


# -- a property's summary line may hold a colon ---------------------------------------
# napoleon reads the first line of a property's or attribute's docstring as
# "type: description" when it has a colon ("Shape of the pool's memory in storage order
# (layer-major): ``shape`` with ..."), and the "type" becomes a broken reference. shmkv's
# docstrings never give a type that way (annotations do), so such a docstring is opened
# with an empty reST comment, a first line without a colon: napoleon then reads "no type".


def _no_inline_type(app, what, name, obj, options, lines):
    if what in ("attribute", "property", "data") and lines and ": " in lines[0]:
        lines[:0] = ["..", ""]


# -- a class built from private parts shows the parts' members, not their names ----------
# A public class that subclasses a private shmkv class shows one class to users: the
# private bases' names are dropped from its "Bases:" line, and the reference lists
# their public members as the class's own (``:inherited-members:`` in api.rst stops at
# the public base).


def _public_bases(app, name, obj, options, bases):
    bases[:] = [
        base
        for base in bases
        if not (
            getattr(base, "__module__", "").startswith("shmkv") and base.__name__.startswith("_")
        )
    ]


def setup(app):
    app.connect("autodoc-process-bases", _public_bases)
    app.connect("autodoc-process-docstring", _no_inline_type, priority=100)  # before napoleon
    app.connect("missing-reference", _resolve_alias)
    app.connect("source-read", _outside_links)
    app.connect("source-read", _every_page_in_toc)
