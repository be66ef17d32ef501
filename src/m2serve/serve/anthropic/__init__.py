"""The Anthropic Messages API: a router and its wire types on the chat pipeline."""
