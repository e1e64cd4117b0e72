"""Models: where a model comes from (family, builder, module) and what in it carries state."""
