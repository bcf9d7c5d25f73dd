"""The quantisation ladder: build a base manifest's recipes in order, compare each with
the unquantised release item by item, price it, and recommend the cheapest that loses nothing
the business needs."""
