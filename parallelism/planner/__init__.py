"""The routing planner: which bytes move where, in which rounds, under which device map, and
what that costs in time and memory. Pure (stdlib and numpy), like parallelism/layout below it."""
