"""Token datasets: on-disk formats, exact sample order, preparation (docs/datasets.md)."""
