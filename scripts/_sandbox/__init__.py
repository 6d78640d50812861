"""scripts/containerd-sandbox's parts, one module a job (the script is the entry; its docstring
says what the sandbox is and the traps it handles)."""
