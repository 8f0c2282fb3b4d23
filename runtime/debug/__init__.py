"""Pass-debugging tools that write files or run commands: crash reproducers and bisection."""
