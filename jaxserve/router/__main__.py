from jaxserve.router import router_main

router_main()
