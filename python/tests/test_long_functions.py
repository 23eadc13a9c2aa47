"""tools/long_functions.py counts what it claims: a function whose signature holds `[T; N]` (a `;`
that does not end a declaration) is measured, a trait method without a body is not."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import long_functions  # noqa: E402


def test_functions_are_measured_from_fn_to_closing_brace(tmp_path):
    body = "\n".join(f"    let x{i} = {i};" for i in range(5))
    src = tmp_path / "a.rs"
    src.write_text(
        "trait T {\n    fn declared(&self) -> [u8; 2];\n}\n"
        f"fn pairs(a: &[u8]) -> (Vec<u8>, [Option<usize>; 2]) {{\n{body}\n    let s = \"}}\";\n    todo!()\n}}\n"
        "pub(crate) fn short() {}\n"
    )
    found = {name: n for name, _, n in long_functions.functions(src)}
    assert found == {"pairs": 9, "short": 1}, found
