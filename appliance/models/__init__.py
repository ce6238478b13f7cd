"""Model families (one file each) composed from appliance/models/layers, and the architecture
registry."""
