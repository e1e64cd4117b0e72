"""The plugin contract: hook specifications, the registries plugins fill, and the manager that loads them."""
