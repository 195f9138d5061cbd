"""The in-process client: what a framework's process links to talk to its worker."""
