"""Training drafts for a target from the target's own outputs (``depctl draft train``): runs in a process of its own,
started by the CLI, and reports progress as JSON lines."""
