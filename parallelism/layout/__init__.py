"""Pure core (stdlib + numpy): layouts, virtual parameter space, routing plans."""
