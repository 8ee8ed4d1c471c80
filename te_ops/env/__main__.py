"""``python -m te_ops.env`` prints the README's environment-variable table.

A package ``__main__`` (not ``if __name__ == "__main__"`` in the module) so that running it
does not re-execute a module ``import te_ops`` already imported (runpy's RuntimeWarning).
"""

from __future__ import annotations

from . import markdown_table

print(markdown_table())
