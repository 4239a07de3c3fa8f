"""The `dynaplane` command: runs the stack, the node agents and the tools."""
