# Builds the tutorial site into OUT/html (run by the docs target and the ctest entry `docs`):
#   cmake -DDOXYGEN=... -DPYTHON=... -DSOURCE=<repo> -DOUT=<build>/docs -DMATHJAX=<dir>
#         [-DBUILD=<build>] -P site.cmake
# The sidebar tree comes from docs/toc.txt (docs/site.py layout); Doxygen then writes html/, and
# what the pages load besides Doxygen's own files is copied in, so html/ is the whole site.
function(run)
  execute_process(COMMAND ${ARGN} WORKING_DIRECTORY ${SOURCE} RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    list(JOIN ARGN " " cmd)
    message(FATAL_ERROR "site: `${cmd}` failed (${rc})")
  endif()
endfunction()

run(${PYTHON} ${SOURCE}/docs/site.py layout ${OUT}/DoxygenLayout.xml)
file(REMOVE_RECURSE ${OUT}/html)  # no page of an earlier build survives a renamed chapter
run(${DOXYGEN} ${OUT}/Doxyfile)

# The chapters' figures and the benchmark CSVs, where docs/site.py points the pages at them.
file(COPY ${SOURCE}/docs/figures/ DESTINATION ${OUT}/html/figures)
file(COPY ${SOURCE}/docs/benchmarks/ DESTINATION ${OUT}/html/benchmarks)
# The published GPU runs (docs/gpu-runs/): the validation and benchmark pages link their logs.
file(COPY ${SOURCE}/docs/gpu-runs/ DESTINATION ${OUT}/html/gpu-runs)
# The figures drawn from runs (timelines, the signal protocol, the loss plot) are made again from
# this build's programs, replacing the committed copies in html/ (scripts/chapter-figures.py).
if(BUILD AND EXISTS ${BUILD}/bin/06_fp8)
  run(${PYTHON} ${SOURCE}/scripts/chapter-figures.py --build ${BUILD} --out ${OUT}/html/figures)
endif()

# The part of MathJax 2 that TeX input and HTML-CSS output with the TeX fonts load (~2 MB of 54).
set(mj ${OUT}/html/mathjax)
file(COPY ${MATHJAX}/MathJax.js ${MATHJAX}/extensions DESTINATION ${mj})
file(COPY ${MATHJAX}/jax/input/TeX DESTINATION ${mj}/jax/input)
file(COPY ${MATHJAX}/jax/element DESTINATION ${mj}/jax)
file(COPY ${MATHJAX}/jax/output/HTML-CSS/config.js ${MATHJAX}/jax/output/HTML-CSS/jax.js
          ${MATHJAX}/jax/output/HTML-CSS/imageFonts.js ${MATHJAX}/jax/output/HTML-CSS/autoload
     DESTINATION ${mj}/jax/output/HTML-CSS)
file(COPY ${MATHJAX}/jax/output/HTML-CSS/fonts/TeX DESTINATION ${mj}/jax/output/HTML-CSS/fonts)
file(COPY ${MATHJAX}/fonts/HTML-CSS/TeX/woff ${MATHJAX}/fonts/HTML-CSS/TeX/otf
     DESTINATION ${mj}/fonts/HTML-CSS/TeX)
file(COPY ${MATHJAX}/localization/en DESTINATION ${mj}/localization)

# Last, the site's own check: no relative link or image leads nowhere, and the front page's diffs
# table renders as a table.
run(${PYTHON} ${SOURCE}/docs/site.py check ${OUT}/html)
