"""The rank processes a node agent runs for a job: training, stop and switch agreement, reports."""
