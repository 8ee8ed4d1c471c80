"""Integrations with other libraries; each submodule imports its library only when imported
itself (``import te_ops`` imports none of them)."""
