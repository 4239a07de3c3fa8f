"""The transition engine (torch): executes a routing plan on real tensors."""
