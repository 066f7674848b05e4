"""The version of xshard: the one place it is written (pyproject.toml reads it from here).

Modules that record it (checkpoint manifests, ``xshard env``) import it from this module rather
than from the package root, whose import sets up the whole user API.
"""

__version__ = "0.1.0"
