"""Engine integrations: record DCP metadata from a running serving engine through dcptool's Recorder."""
