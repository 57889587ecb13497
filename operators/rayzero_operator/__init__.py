"""The RayZeroJob operator: reconciles RayZeroJob custom resources into KubeRay RayJobs."""
