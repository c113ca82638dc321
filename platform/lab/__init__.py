"""The tools around the server: benchmarks, the simulator and its workloads, the demo,
capacity planning and the activation-cache commands. The only platform room that may import
torch and diffusers; imports the server's rooms (to start and measure them), never the CLI."""
