__version__ = "0.1.0"

import sys as _sys
# jsonschema, under nbformat and papermill, imports rfc3987_syntax where it is installed (jupyter-events pulls it in) for
# one string format, "iri", and that import compiles 39 grammars: 3-6 s of every process that reads a notebook (each book,
# each of its workers, each `capbook docs`). No notebook schema checks an "iri" string, so a capbook process goes without it.
_sys.modules.setdefault("rfc3987_syntax", None)
