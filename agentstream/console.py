"""The console the demos and ``agentstream report`` print through: rich, under one rule for line breaks.

Rich never breaks a printed line. Every ``print`` is soft-wrapped: a line goes out whole however long it is
(a command to paste, a path, a URL, the machine's calibration), as ``click.echo`` prints the other commands'
lines. On a terminal the terminal folds a long line on screen, and a copy of it pastes as one line; rich would
instead put a newline into it at the terminal's width (80 columns when it cannot tell), so a command printed
for the user came out in two pieces.

Off a terminal (a pipe, a file, a captured log) there are no colours and no highlighting, and the width is
:data:`OFF_TERMINAL_WIDTH`, so a table takes the width its cells need: no cell is folded, cut or ellipsised.
The one thing that fills the width, a rule, is drawn :data:`RULE_WIDTH` wide there (or as wide as its title
needs). On a terminal a rule whose title does not fit prints the title whole above a bare rule, where rich
would cut it short with an ellipsis.
"""

from __future__ import annotations

from typing import IO

from rich.align import AlignMethod
from rich.cells import cell_len
from rich.console import Console
from rich.rule import Rule
from rich.style import Style
from rich.text import Text, TextType

OFF_TERMINAL_WIDTH = 10_000
"""The console's width off a terminal: wider than any table the product prints."""
RULE_WIDTH = 80
"""A rule's width off a terminal, unless its title needs more."""


class ProductConsole(Console):
    """A rich Console whose ``rule`` keeps its title whole and, off a terminal, stays :data:`RULE_WIDTH` wide."""

    def rule(self, title: TextType = "", *, characters: str = "─", style: str | Style = "rule.line",
             align: AlignMethod = "center") -> None:
        plain = title.plain if isinstance(title, Text) else self.render_str(title).plain
        room = cell_len(plain) + 6  # the title and a short line either side
        width = self.width if self.is_terminal else min(self.width, max(RULE_WIDTH, room))
        if plain and room > width:  # rich would end the title in an ellipsis: print it whole, then the line
            self.print(title, style="rule.text", highlight=False)
            title = ""
        self.print(Rule(title, characters=characters, style=style, align=align), width=width)


def product_console(file: IO[str] | None = None, *, force_terminal: bool | None = None) -> ProductConsole:
    """The console to print through (to ``file``, standard output when None), by the rule in this module's docstring.

    ``force_terminal`` overrides the detection (tests); otherwise rich's own decides (a TTY, ``FORCE_COLOR``,
    ``TTY_COMPATIBLE``).
    """
    terminal = Console(file=file, force_terminal=force_terminal).is_terminal
    if terminal:
        return ProductConsole(file=file, force_terminal=force_terminal, soft_wrap=True)
    return ProductConsole(file=file, force_terminal=force_terminal, soft_wrap=True, width=OFF_TERMINAL_WIDTH,
                          no_color=True, highlight=False)
