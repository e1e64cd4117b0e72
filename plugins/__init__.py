"""snnfw's built-in plugins, each registered through the ``snnfw`` entry-point group."""
