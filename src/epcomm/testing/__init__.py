"""Testing tools, kept apart from the library's data paths:

- `reference`: an independent, plain-torch reference of dispatch and combine (the semantics of
  docs/semantics.md, written without any of the backends' code);
- `verify`: random cases (uneven counts, `-1` ids, empty receivers, skew, memory forms) and the
  bitwise comparison of a `Buffer`'s results against the reference;
- `launch`: running a function on several local ranks (processes), CPU or GPU.

Tests, the benchmark and the scripts compare through these; nothing in the library imports them.
"""
