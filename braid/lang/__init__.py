"""The braid language (`@function`, `gen`, `select`, `fork`): see issue "The braid language".
Nothing is exported yet; the runtime it compiles to lives in `braid.runtime`."""
