/* Loaded (by releasekit/_support/floatpins.py, before torch) into processes that pin their
   float code paths, on x86-64 processors that are not Intel's: the demo's training and the
   quantisation process on the CPU.

   MKL honours MKL_CBWR's instruction-set branches (the pins ask for AVX2, strict) only on
   processors it takes for Intel's: on any other it runs its AUTO branch instead, silently
   (MKL's documentation: "Settings other than AUTO or COMPATIBLE are available only for Intel
   processors"). On a 2-core AMD EPYC host with AVX2 that branch is MKL's generic one, whose
   sums round otherwise, and the training gave other weights than on Intel hosts. MKL asks
   whether the processor is Intel's through this function; answering yes makes it take the
   AVX2 branch the pins ask for, which the processor runs (it is loaded only where the CPU has
   AVX2 and FMA). Nothing else loads it: servers keep MKL's own choice. */
int mkl_serv_intel_cpu_true(void) { return 1; }
