"""The command line: argparse and one module per verb; nothing below imports this."""
